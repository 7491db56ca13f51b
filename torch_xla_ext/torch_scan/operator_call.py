"""`scan`'s contract, `fn(carry, x) -> (carry, y)` over pytrees, as one call
of torch's scan operator: for code that `torch.export` traces, where the call
is one node of the exported graph (which `exported_program_to_stablehlo`
lowers to one `stablehlo.while` while `register_torch_scan` is in effect).

The operator takes less than `scan` does. Its body may not write its inputs
in place, nor return one of its inputs or one output twice, and the carry it
returns must have the shapes and dtypes of the carry it got. So before the
call, `rehearse` runs `fn` once on fakes of the first step's inputs (no data;
its own fake mode, apart from the caller's trace, so that nothing of it enters
the traced graph) and decides
what the call can be:

* the carry leaves `fn` hands back as it got them, unwritten, are read-only:
  they enter the operator as additional inputs (loop-invariant, gradients
  flowing to them), and the final carry holds them as they were;
* a carry leaf `fn` writes in place (a state the loop updates: a key/value
  cache's stacked buffers) is given to `fn` as a copy inside the body, which
  `fn` writes and the body returns as the new carry: the write is the
  loop's output, not a change of the operator's input;
* an output that is one of the step's inputs, or an output already given,
  is cloned in the body; an output that is None is no output of the
  operator's, and None in `ys`;
* a slice of `xs` written in place (its version counter moved), a carry
  whose shape or dtype changes, or an output that is not a tensor: the
  operator cannot take `fn`, and the rehearsal says why (a str), before
  anything of the call is traced.

The caller's own checks of `fn` (a reading of a value that differs between
steps, say) run in the rehearsal too, since it runs `fn` as the operator's
trace will.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from torch_xla_ext.diagnostics import Refusal

__all__ = ["Rehearsed", "rehearse", "scan_through_operator"]


@dataclasses.dataclass(frozen=True)
class Rehearsed:
    """What one run of `fn` on fakes showed: which carry leaves it hands back
    unchanged (`read_only`) and which it writes in place (`written`), by
    position among the carry's leaves, and the form of what it returns."""
    read_only: tuple[int, ...]
    written: tuple[int, ...]  # the carry leaves it writes in place
    carry_spec: TreeSpec
    ys_spec: TreeSpec
    nones: tuple[int, ...]  # the output leaves that are None (the operator returns none of them)


def rehearse(fn: Callable, init, xs) -> Rehearsed | Refusal:
    """Runs `fn` once on fakes of `init` and of `xs`'s first slices (see the
    module docstring): what the operator's call can be, or why torch's
    operator cannot take `fn`."""
    init_leaves, init_spec = tree_flatten(init)
    xs_leaves, xs_spec = tree_flatten(xs)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    carry_fakes = [_fake(mode, leaf.shape, leaf) for leaf in init_leaves]
    x_fakes = [_fake(mode, leaf.shape[1:], leaf) for leaf in xs_leaves]
    versions = [fake._version for fake in (*carry_fakes, *x_fakes)]
    with disable_proxy_modes_tracing(), mode:
        carry, y = fn(tree_unflatten(carry_fakes, init_spec), tree_unflatten(x_fakes, xs_spec))
    written = [number for number, (fake, version) in enumerate(
        zip((*carry_fakes, *x_fakes), versions)) if fake._version != version]
    scanned_written = [number - len(carry_fakes) for number in written
                       if number >= len(carry_fakes)]
    if scanned_written:
        return Refusal(f"the step writes its slices of xs leaves {scanned_written} in place, "
                       f"and torch's scan operator takes a step that writes none of its inputs")
    carry_leaves, carry_spec = tree_flatten(carry)
    if carry_spec != init_spec:
        return Refusal(f"the step returns a carry of another form ({carry_spec}) than it "
                       f"gets ({init_spec})")
    for number, (given, returned) in enumerate(zip(carry_fakes, carry_leaves)):
        if not isinstance(returned, torch.Tensor) or (returned.shape, returned.dtype) != (
                given.shape, given.dtype):
            return Refusal(f"the step returns carry leaf {number} as {_aval(returned)}, and "
                           f"gets it as {_aval(given)}: torch's scan operator keeps a carry's "
                           f"shape and dtype")
    y_leaves, ys_spec = tree_flatten(y)
    for number, leaf in enumerate(y_leaves):
        if not isinstance(leaf, (torch.Tensor, type(None))):
            return Refusal(f"the step's output leaf {number} is a {type(leaf).__name__}, and "
                           f"torch's scan operator stacks tensors only")
    read_only = tuple(number for number, (given, returned) in enumerate(
        zip(carry_fakes, carry_leaves)) if returned is given and number not in written)
    return Rehearsed(read_only, tuple(written), carry_spec, ys_spec,
                     tuple(number for number, leaf in enumerate(y_leaves) if leaf is None))


def scan_through_operator(fn: Callable, init, xs, rehearsed: Rehearsed):
    """`scan(fn, init, xs)`'s `(carry, ys)` from one call of
    `torch.ops.higher_order.scan`, as `rehearsed` (`rehearse`'s) says."""
    init_leaves, init_spec = tree_flatten(init)
    xs_leaves, xs_spec = tree_flatten(xs)
    read_only = rehearsed.read_only
    carried = [number for number in range(len(init_leaves)) if number not in read_only]
    # The operator's operands must be distinct tensors: a read-only leaf
    # given twice (an argument shared by the calls of a group of layers) is
    # one additional input, and a carried or scanned one given twice a copy.
    invariants = list({id(init_leaves[number]): init_leaves[number]
                       for number in read_only}.values())
    invariant_at = [next(place for place, each in enumerate(invariants)
                         if each is init_leaves[number]) for number in read_only]
    seen = {id(each) for each in invariants}
    operands = []
    for leaf in [init_leaves[number] for number in carried] + xs_leaves:
        operands.append(leaf.clone() if id(leaf) in seen else leaf)
        seen.add(id(leaf))

    def body(*leaves):
        carry_leaves = list(init_leaves)  # each position is set below
        for position, leaf in zip(carried, leaves):
            carry_leaves[position] = leaf.clone() if position in rehearsed.written else leaf
        rest = leaves[len(carried):]
        x_leaves, invariant = rest[:len(xs_leaves)], rest[len(xs_leaves):]
        for position, place in zip(read_only, invariant_at):
            carry_leaves[position] = invariant[place]
        carry, y = fn(tree_unflatten(carry_leaves, init_spec), tree_unflatten(x_leaves, xs_spec))
        new_carry = tree_flatten(carry)[0]
        outputs = [new_carry[position] for position in carried] + [
            leaf for leaf in tree_flatten(y)[0] if leaf is not None]
        return [output.clone() if _seen_before(output, leaves, outputs[:number]) else output
                for number, output in enumerate(outputs)]

    flat = torch.ops.higher_order.scan(body, operands[:len(carried)], operands[len(carried):],
                                       tuple(invariants))
    final = list(init_leaves)
    for position, leaf in zip(carried, flat[:len(carried)]):
        final[position] = leaf
    stacked = iter(flat[len(carried):])
    ys = [None if number in rehearsed.nones else next(stacked)
          for number in range(rehearsed.ys_spec.num_leaves)]
    return tree_unflatten(final, rehearsed.carry_spec), tree_unflatten(ys, rehearsed.ys_spec)


def _seen_before(output: Any, inputs: tuple, earlier: list) -> bool:
    return any(output is each for each in (*inputs, *earlier))


def _fake(mode: FakeTensorMode, shape, like: torch.Tensor) -> torch.Tensor:
    with disable_proxy_modes_tracing(), mode:
        made = torch.empty(tuple(shape), dtype=like.dtype)
    return made.requires_grad_(like.requires_grad and like.dtype.is_floating_point)


def _aval(leaf) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"{tuple(leaf.shape)} {leaf.dtype}"
    return type(leaf).__name__
