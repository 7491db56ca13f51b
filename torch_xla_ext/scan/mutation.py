"""In-place writes `fn` makes to what it receives or captures, handled as the
for loop would leave them.

`fn` may write in place to its arguments and to tensors it captures
(`counter.add_(1)`, `buf[i] = v`, `buf.copy_(v)`, a BatchNorm in training mode
updating its running statistics). After the trace, each stand-in's value is
compared with its value before `fn` ran (XLA tensors are functional wrappers:
an in-place op gives the wrapper a new value and leaves the old one as it was),
and scan then does what the loop does:

- a captured tensor `fn` writes becomes a loop carry: each step sees the
  earlier steps' writes, and after the loop its final value is copied into the
  captured tensor, the very object the caller holds (a module's buffer);
- an x slice `fn` writes is stacked like a y and copied into its `xs` leaf
  after the loop, as the loop writes `xs[i]` through the slice;
- a write to the carry is seen by the rest of its step, and what `fn` returns
  is the next carry; `init` is never written (scan's inputs are values).

Writes scan cannot make as the loop does raise when `fn` is traced: to a
tensor that requires grad, of a value that requires grad (written tensors are
carried without gradients), changing a tensor's shape or dtype, and (checked
at every call) to a tensor that shares memory with another of scan's inputs,
which would miss the write.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
import torch_xla

from torch_xla_ext.placeholders import mark_derived
from torch_xla_ext.scan.avals import Aval, Structure
from torch_xla_ext.object_graph import describe, find_paths

_XLAC = torch_xla._XLAC


def _value(tensor: torch.Tensor) -> torch.Tensor:
    """The XLA tensor a functional wrapper currently holds."""
    torch._sync(tensor)  # applies writes made through views of `tensor`
    return torch._from_functional_tensor(tensor)


def _value_id(value: torch.Tensor):
    """Identifies what an XLA tensor holds now: its data, else its IR value.
    (Data goes first: an op reading the data gives the tensor an IR value too.)"""
    try:
        return _XLAC._get_tensors_handle([value])[0]
    except RuntimeError:  # torch_xla's check: the tensor holds no data
        return _XLAC._unique_id_for_ir_and_data(value)


def unaliased(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor holding `tensor`'s current value, made without a copy, that
    `write_back` into `tensor` leaves as it is (autograd may keep it)."""
    return torch._to_functional_tensor(_value(tensor))


class Writes:
    """Watches XLA tensors (a trace's stand-ins): which were written in place
    since, and their values before.

    A write reaches a stand-in in one of two ways: through functionalization,
    which gives the wrapper a new XLA tensor and leaves the old one as it was,
    or (some torch_xla kernels, such as batch norm's update of its running
    statistics) by giving the wrapper's XLA tensor itself a new IR value."""

    def __init__(self, tensors: Sequence[torch.Tensor] = ()):
        self._before: dict = {}
        for tensor in tensors:
            self.watch(tensor)

    def watch(self, tensor: torch.Tensor) -> None:
        if id(tensor) not in self._before:
            value = _value(tensor)
            self._before[id(tensor)] = (tensor, value, _value_id(value))

    def written(self, tensor: torch.Tensor) -> bool:
        _, value, value_id = self._before[id(tensor)]
        return _value(tensor) is not value or _value_id(value) != value_id

    def originals(self, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> list:
        """Each of `tensors` (stand-ins holding data) as it was before `fn` ran:
        itself unless `fn` wrote it, else another tensor over its old data, or
        None where none of `outputs` reads that data any more."""
        result, overwritten = [], {}
        for tensor in tensors:
            _, value, value_id = self._before[id(tensor)]
            if not self.written(tensor):
                result.append(tensor)
            elif _value_id(value) == value_id:
                result.append(torch._to_functional_tensor(value))
            else:  # written in place: the data is now only an input of IR values
                overwritten[len(result)] = value_id
                result.append(None)
        if overwritten:
            # Lowering the outputs yields a tensor over each piece of data they read.
            context = _XLAC.lowering.LoweringContext("scan_written_inputs")
            context.build(list(outputs))
            read = {_value_id(t): t for t in context.device_parameter_id_tensor_mapping().values()}
            for position, value_id in overwritten.items():
                result[position] = read.get(value_id)
        return result


class Written(NamedTuple):
    """Which of a trace's inputs `fn` wrote in place."""
    carry: tuple    # per carry leaf, a bool
    x: tuple        # indices of the x slices written
    captures: tuple  # indices of the captures written

    def any_written_back(self) -> bool:
        return bool(self.x or self.captures)


def find_writes(writes: Writes, carry_arg, x_arg, x_avals, capture_stand_ins, captured,
                describe_x: Callable[[int], str],
                describe_capture: Callable[[int], str]) -> Written:
    """What `fn` wrote, after checking that scan can write it as the loop does
    (raises TypeError/ValueError naming the tensor otherwise)."""
    x = tuple(i for i, t in enumerate(x_arg) if writes.written(t))
    for i in x:
        check_written(x_arg[i], x_avals[i], x_avals[i].requires_grad, describe_x(i))
    captures = tuple(i for i, t in enumerate(capture_stand_ins) if writes.written(t))
    for i in captures:
        check_written(capture_stand_ins[i], Aval.of(captured[i]), captured[i].requires_grad,
                      describe_capture(i))
    return Written(tuple(writes.written(t) for t in carry_arg), x, captures)


def describe_x(xs_tree: Structure, i: int) -> str:
    return f"the slices of {xs_tree.leaf_path('xs', i)}"


def describe_capture(fn, captured: Sequence[torch.Tensor], i: int) -> str:
    """Names capture `i` of `fn` by where `fn` reaches it, if it can."""
    tensor = captured[i]
    path = find_paths(fn, [tensor])[0]
    where = f" as {describe(fn, path)}" if path is not None else _global_name(fn, tensor)
    return f"the {Aval.of(tensor)} tensor fn captures{where}"


def _global_name(fn, tensor: torch.Tensor) -> str:
    """' as global NAME' (or NAME.buffer of a global module) when `fn` reads
    `tensor` through a module-level name, else ''."""
    code, module_globals = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    for name in code.co_names if code is not None else ():
        value = module_globals.get(name)
        if value is tensor:
            return f" as global {name}"
        if isinstance(value, torch.nn.Module):
            for path, candidate in (*value.named_parameters(), *value.named_buffers()):
                if candidate is tensor:
                    return f" as global {name}.{path}"
    return ""


def check_written(value: torch.Tensor, aval: Aval, requires_grad: bool, what: str) -> None:
    """`value` is what `fn` left in the tensor `what` (of `aval`)."""
    if requires_grad:
        raise TypeError(
            f"scan: fn writes in place to {what}, which requires grad; scan carries the "
            f"tensors fn writes without gradients. Write to a tensor that does not require "
            f"grad (a buffer), or return the new value as part of the carry instead")
    if (tuple(value.shape), value.dtype) != (aval.shape, aval.dtype):
        raise ValueError(
            f"scan: fn changes {what} to a {Aval.of(value)} tensor in place; scan can write "
            f"back only values of the tensor's own shape and dtype. Make a new tensor and "
            f"return it in the carry instead")
    if value.requires_grad:
        raise TypeError(
            f"scan: fn writes a value that requires grad into {what}; scan carries the "
            f"tensors fn writes without gradients, where the loop would make that tensor part "
            f"of the autograd graph. Write a detached value (`.detach()`), or return it as "
            f"part of the carry instead")


def check_unaliased(inputs: Sequence[torch.Tensor], written: Sequence[int],
                    describe: Callable[[int], str]) -> None:
    """Each input scan writes back (positions `written` of `inputs`, all of a
    call's input tensors) must be the only input over its memory: `fn` sees
    every input through a stand-in of its own, so another view of that memory
    would not see the write."""
    storages = [_storage(t) for t in inputs]
    for target in written:
        for other, storage in enumerate(storages):
            if other != target and storage == storages[target]:
                raise ValueError(
                    f"scan: fn writes in place to {describe(target)}, which shares memory "
                    f"with {describe(other)}, another of scan's inputs; fn sees them as "
                    f"separate tensors, so the write would not show in the other. Pass only "
                    f"one of them to scan (capture the whole tensor and index it in fn)")


def _storage(tensor: torch.Tensor) -> int:
    # A placeholder's storage is no value: asking for its identity is safe.
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.untyped_storage()._cdata


def write_back(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               sources: tuple) -> None:
    """Gives each target tensor its new value, keeping the object the caller
    holds (and writing through to what it is a view of). The value replaces the
    target's XLA tensor rather than being copied into it: an in-place copy
    would also change the `unaliased` values of it that autograd keeps. Like
    torch_xla's own batch norm update, no autograd graph is recorded and the
    version counter stays. `sources`: the placeholders the values depend on."""
    for target, value in zip(targets, values):
        torch._functionalize_replace(target, _value(value))
        torch._functionalize_commit_update(target)
        mark_derived(target, sources)
