"""`placeholder()`, and the marking of what is computed from placeholders.

Placeholders are `PlaceholderTensor`s, and every tensor computed from one
(or written in place from one, or a gradient accumulated through one)
becomes one too, carrying the placeholders it depends on
(`_placeholder_sources`). Each call on a `PlaceholderTensor` is where the
guards on reads run (`reads`).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch.utils._pytree import tree_flatten

from torch_xla_ext.placeholders.reads import DataReadGuard, check_values, reads_value
from torch_xla_ext.placeholders.registry import (
    check_device, check_dtype, check_sizes, depends_on_placeholder, registered_placeholder,
    track_derived)
from torch_xla_ext.placeholders.syncs import guard_syncs

_BACKWARD_FUNCTIONS = frozenset([torch.Tensor.backward, torch.autograd.backward])


class PlaceholderTensor(torch.Tensor):
    """A tensor that is a placeholder or is computed from placeholders.

    `_placeholder_sources` holds the `_C.PlaceholderData` objects it depends on
    (for messages, and to keep their ids valid while it lives).
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if reads_value(func, args, kwargs):
            check_values([leaf for leaf in tree_flatten((args, kwargs))[0]
                          if isinstance(leaf, PlaceholderTensor)], func)
        sources = placeholder_sources(args, kwargs)
        if func in _BACKWARD_FUNCTIONS:
            return _backward_marking_gradients(func, args, kwargs, sources)
        try:
            with torch._C.DisableTorchFunctionSubclass(), DataReadGuard(sources, func):
                result = func(*args, **kwargs)
        except Exception as error:
            _guard_what_the_traceback_holds(error, sources)
            raise
        mark_derived(result, sources)
        if mutates_arguments(func):
            mark_derived(args[0] if args else None, sources)
            mark_derived(kwargs.get("out"), sources)
        return result


def _guard_what_the_traceback_holds(error: BaseException, sources: tuple) -> None:
    """Marks the tensors the frames of `error`'s traceback hold that are
    computed from placeholders but unmarked (a composite op's intermediates,
    in the frames below a failed call): a traceback printer that shows them
    (pytest, a debugger) would read them, and a sync execute them, and
    executing a graph that reads a placeholder kills the process."""
    entry = error.__traceback__
    while entry is not None:
        for value in list(entry.tb_frame.f_locals.values()):
            for leaf in tree_flatten(value)[0]:
                if type(leaf) is torch.Tensor and depends_on_placeholder(leaf):
                    mark_derived(leaf, sources)
        entry = entry.tb_next


def placeholder(shape: int | Sequence[int], dtype: torch.dtype = torch.float32, *,
                requires_grad: bool = False, device=None) -> torch.Tensor:
    """An XLA tensor with this shape and dtype and no device buffer.

    Use it to trace and lower a computation without moving data. Reading its
    value, or the value of anything computed from it, raises `PlaceholderError`.
    """
    sizes = check_sizes(shape)
    check_dtype(dtype)
    ordinal = check_device(device)
    if not isinstance(requires_grad, bool):
        raise TypeError(f"requires_grad must be a bool, got {requires_grad!r}")
    if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"requires_grad=True needs a floating point or complex dtype, "
                         f"got {dtype}; only such tensors can have gradients")
    guard_syncs()
    tensor = registered_placeholder(sizes, dtype, ordinal)
    tensor.__class__ = PlaceholderTensor
    tensor._placeholder_sources = (tensor._placeholder_data,)
    track_derived(tensor)
    return tensor.requires_grad_(requires_grad)


def unguarded_placeholder(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A placeholder as a plain `torch.Tensor`: registered with the C++ core
    like any other, but reading it is not guarded. For AOTAutograd, which
    inspects its inputs' storage while it fakeifies them."""
    sizes = check_sizes(shape)
    check_dtype(dtype)
    guard_syncs()
    return registered_placeholder(sizes, dtype, check_device(None))


def placeholder_sources(args, kwargs=None) -> tuple:
    """The placeholders (C++ data objects) that tensors in `args` and `kwargs`
    are computed from."""
    sources = []
    for leaf in tree_flatten((args, kwargs))[0]:
        for source in getattr(leaf, "_placeholder_sources", ()):
            if not any(source is seen for seen in sources):
                sources.append(source)
    return tuple(sources)


def mark_derived(result, sources: tuple) -> None:
    """Marks the XLA tensors in `result` as computed from `sources`, so that
    reading them raises PlaceholderError and a sync discards their pending work."""
    if not sources:
        return
    for leaf in tree_flatten(result)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "xla":
            # Plain tensors change class so that reading them is guarded too;
            # other classes (nn.Parameter) are only tracked for the sync guard.
            if type(leaf) is torch.Tensor:
                leaf.__class__ = PlaceholderTensor
            leaf._placeholder_sources = tuple(
                dict.fromkeys(getattr(leaf, "_placeholder_sources", ()) + sources))
            track_derived(leaf)


_IN_PLACE_DUNDERS = frozenset(["__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"])


def mutates_arguments(func) -> bool:
    """Whether `func` (a torch function or Tensor method) writes its first
    argument, or its `out`, in place: by torch's naming (`add_`, `__iadd__`)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_DUNDERS


def _backward_marking_gradients(func, args, kwargs, sources: tuple):
    """Runs a backward pass and marks the gradients it accumulates, which
    depend on the placeholders the graph read."""
    roots = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    leaves = list(_accumulating_leaves(t.grad_fn for t in roots))
    try:
        with torch._C.DisableTorchFunctionSubclass(), DataReadGuard(sources, func):
            result = func(*args, **kwargs)
    except Exception as error:
        _guard_what_the_traceback_holds(error, sources)
        raise
    for leaf in leaves:
        mark_derived(leaf.grad, sources)
    return result


def _accumulating_leaves(grad_fns: Iterable) -> Iterable[torch.Tensor]:
    stack, seen = [fn for fn in grad_fns if fn is not None], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            yield variable
        stack.extend(next_fn for next_fn, _ in node.next_functions if next_fn is not None)
