"""A nested scan that cannot run as a loop of its own (`nested` says when)
runs as its for loop, inlined into the outer trace, so each outer step holds
every inner step.

The outer trace is what gets lowered and differentiated; the inner call adds
no loop and no RNG bookkeeping of its own (its trace, which showed that it
cannot be a loop, stays cached), and the inner fn's Python body runs once per
inner step while the outer fn is traced.
Writes are the for loop's too: what fn writes in place to its first carry is
written to `init` (a top-level scan never writes `init`)."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from torch_xla_ext.placeholders import mutates_arguments
from torch_xla_ext.scan.avals import (Aval, avals, check_carry_types, check_y_leaves, empty_stack,
                                      flatten_inputs, scan_length)
from torch_xla_ext.scan.tracing import call_body


def inline_scan(fn, init, xs, reverse: bool):
    """`scan(fn, init, xs, reverse=reverse)` as the for loop, unrolled."""
    carry_leaves, carry_tree = flatten_inputs(init, "init")
    xs_leaves, xs_tree = flatten_inputs(xs, "xs")
    length = scan_length(xs_leaves, xs_tree)
    init_avals = avals(carry_leaves)
    if length == 0:
        return init, _empty_ys(fn, carry_leaves, carry_tree, init_avals, xs_leaves, xs_tree)
    carry, steps = init, [None] * length
    for i in (reversed(range(length)) if reverse else range(length)):
        # Views, as in the for loop: what fn writes to its slice reaches xs.
        carry, y = call_body(fn, carry, xs_tree.unflatten([x[i] for x in xs_leaves]))
        carry = carry_tree.unflatten(check_carry_types(carry_tree, init_avals, carry))
        steps[i] = check_y_leaves(y)
    y_leaves, y_tree = steps[0]
    for i, (leaves, tree) in enumerate(steps):
        if tree != y_tree or _types(leaves) != _types(y_leaves):
            raise TypeError(f"scan: fn returned a y at step {i} whose structure, shapes or dtypes "
                            f"differ from those at step 0; the steps' ys must be alike to be "
                            f"stacked")
    return carry, y_tree.unflatten([torch.stack(leaf_steps)
                                    for leaf_steps in zip(*(leaves for leaves, _ in steps))])


def _types(tensors) -> list:
    return [(t.shape, t.dtype) for t in tensors]


def _empty_ys(fn, carry_leaves, carry_tree, init_avals, xs_leaves, xs_tree):
    """The ys of no steps: empty stacks shaped as fn's y, which one run of fn on
    zeros shows (its results are dropped, so the outer step leaves them out)."""
    probe_carry = [leaf.clone() for leaf in carry_leaves]
    probe_x = [x.new_zeros(x.shape[1:]) for x in xs_leaves]
    with _WritesRefused(probe_carry + probe_x):
        carry, y = call_body(fn, carry_tree.unflatten(probe_carry), xs_tree.unflatten(probe_x))
    check_carry_types(carry_tree, init_avals, carry)
    y_leaves, y_tree = check_y_leaves(y)
    return y_tree.unflatten([empty_stack(a, xs_leaves) for a in avals(y_leaves)])


class _WritesRefused(TorchFunctionMode):
    """Refuses in-place writes to tensors other than `own` and those computed
    under it: a scan of no steps writes nothing."""

    def __init__(self, own):
        super().__init__()
        self._own = {id(t): t for t in own}  # kept alive, so that ids stay unique

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if (mutates_arguments(func) and isinstance(target, torch.Tensor)
                and id(target) not in self._own):
            raise NotImplementedError(
                f"scan: nested scans over xs of 0 steps whose fn writes in place "
                f"({getattr(func, '__name__', func)}) to a {Aval.of(target)} tensor it did not "
                f"make are not supported: the write would happen though no step runs. Skip "
                f"the inner scan when xs is empty, or return the value in the carry")
        result = func(*args, **kwargs)
        for leaf in tree_leaves(result):
            if isinstance(leaf, torch.Tensor):
                self._own[id(leaf)] = leaf
        return result
