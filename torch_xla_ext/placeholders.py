"""Placeholder tensors: XLA tensors with a shape and a dtype but no device buffer.

They exist to stage out HLO: trace a function on placeholders, lower the result,
and no byte moves to the device. Each one is registered with the C++ core, which
gives it a process-unique id (torch_xla's own placeholders are keyed on object
addresses, which are reused once freed), describes it in every error message
and lists the ones alive (`live_placeholders()`).

A placeholder has no value, so anything that would read one must fail cleanly
rather than crash the process, as torch_xla 2.9.0 does when it executes a graph
that reads a placeholder. Three mechanisms see to that:

* Placeholders are `PlaceholderTensor`s, and every tensor computed from one (or
  written in place from one, or a gradient accumulated through one) becomes one
  too. Reading the value of a `PlaceholderTensor` that really depends on
  placeholder data raises `PlaceholderError` naming it, and so does any ATen
  op that would read its data on the way (`DataReadGuard`: ops whose output
  shape depends on the data, such as `nonzero`, and ops torch_xla runs on the
  CPU); in torch_xla 2.9.0 they kill the process.
* Every sync entry point of torch_xla (`torch_xla.sync()`, `xm.mark_step()`,
  ...) first discards the pending computations that read placeholders: their
  tensors become value-less placeholders themselves, so the sync runs the rest
  and later reads raise `PlaceholderError`.
* While `scan` traces a function, syncing raises `PlaceholderError`.

The sync guard is the one process-wide patch: importing this module installs
nothing; the first placeholder (or `tracing` region) installs it, once.
"""
from __future__ import annotations

import contextlib
import functools
import operator
import os
import sysconfig
import threading
import traceback
import warnings
import weakref
from typing import Iterable, NamedTuple, Sequence

import torch
import torch_xla
import torch_xla.core.xla_builder as xla_builder
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torch_xla_ext import _C

PlaceholderError = _C.PlaceholderError
PlaceholderError.__module__ = "torch_xla_ext"
PlaceholderError.__doc__ = (
    "Raised when the value of a placeholder, or of a tensor computed from one, "
    "is needed: placeholders have a shape and a dtype but no data.")

SUPPORTED_DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    torch.complex64, torch.complex128)

_XLAC = torch_xla._XLAC

# Tensor methods and functions whose result is the data itself, in host memory.
_VALUE_READERS = frozenset([
    torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy,
    torch.Tensor.__repr__, torch.Tensor.__str__, torch.Tensor.__format__,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__complex__, torch.Tensor.__index__, torch.Tensor.__array__,
    torch.Tensor.__dlpack__, torch.Tensor.__reduce_ex__, torch.Tensor.data_ptr,
    torch.Tensor.untyped_storage, torch.Tensor.equal, torch.equal, torch.allclose,
    torch.Tensor.allclose, torch.Tensor.is_nonzero, torch.is_nonzero,
])
# Functions that move data to another device when asked to.
_DEVICE_MOVERS = frozenset([torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.__setitem__])
_BACKWARD_FUNCTIONS = frozenset([torch.Tensor.backward, torch.autograd.backward])


class PlaceholderTensor(torch.Tensor):
    """A tensor that is a placeholder or is computed from placeholders.

    `_placeholder_sources` holds the `_C.PlaceholderData` objects it depends on
    (for messages, and to keep their ids valid while it lives).
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VALUE_READERS or (func in _DEVICE_MOVERS and _leaves_xla(func, args, kwargs)):
            _raise_if_value_missing(args, kwargs, func)
        sources = placeholder_sources(args, kwargs)
        if func in _BACKWARD_FUNCTIONS:
            return _backward_marking_gradients(func, args, kwargs, sources)
        with torch._C.DisableTorchFunctionSubclass(), DataReadGuard(sources, func):
            result = func(*args, **kwargs)
        mark_derived(result, sources)
        if _mutates_arguments(func):
            mark_derived(args[0] if args else None, sources)
            mark_derived(kwargs.get("out"), sources)
        return result


def placeholder(shape: int | Sequence[int], dtype: torch.dtype = torch.float32, *,
                requires_grad: bool = False, device=None) -> torch.Tensor:
    """An XLA tensor with this shape and dtype and no device buffer.

    Use it to trace and lower a computation without moving data. Reading its
    value, or the value of anything computed from it, raises `PlaceholderError`.
    """
    sizes = _check_sizes(shape)
    _check_dtype(dtype)
    ordinal = _check_device(device)
    if not isinstance(requires_grad, bool):
        raise TypeError(f"requires_grad must be a bool, got {requires_grad!r}")
    if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"requires_grad=True needs a floating point or complex dtype, "
                         f"got {dtype}; only such tensors can have gradients")
    tensor = _registered_placeholder(sizes, dtype, ordinal)
    tensor.__class__ = PlaceholderTensor
    tensor._placeholder_sources = (tensor._placeholder_data,)
    _live_derived[id(tensor)] = tensor
    return tensor.requires_grad_(requires_grad)


def unguarded_placeholder(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A placeholder as a plain `torch.Tensor`: registered with the C++ core
    like any other, but reading it is not guarded. For AOTAutograd, which
    inspects its inputs' storage while it fakeifies them."""
    sizes = _check_sizes(shape)
    _check_dtype(dtype)
    return _registered_placeholder(sizes, dtype, _check_device(None))


def _registered_placeholder(sizes: list[int], dtype: torch.dtype, ordinal: int) -> torch.Tensor:
    """Every placeholder torch_xla_ext makes comes from here: torch_xla's
    placeholder tensor, carrying (and keeping alive) the C++ core's
    `PlaceholderData` that gives it its id, as `_placeholder_data`."""
    _install_sync_guard()
    data = _C.create_placeholder(sizes, dtype, ordinal)
    tensor = xla_builder.create_placeholder_tensor(sizes, dtype)
    tensor._placeholder_data = data
    return tensor


class LivePlaceholder(NamedTuple):
    """A placeholder alive in this process, as `live_placeholders()` lists it."""
    id: int
    dtype: torch.dtype
    sizes: tuple[int, ...]
    description: str  # as every error message names it: "float32[2,3] placeholder #7"


def live_placeholders() -> list[LivePlaceholder]:
    """The placeholders alive in this process, oldest first: those made by
    `placeholder()`, the stand-ins of a `scan` trace in progress, and tensors
    whose pending work a sync discarded. A placeholder lives as long as a tensor
    that is it or is computed from it. `scan`'s cache holds none: a cached trace
    keeps HLO computations, a parameter plan and device-data constants."""
    return [LivePlaceholder(id_, dtype, tuple(sizes), description)
            for id_, dtype, sizes, description in _C.live_placeholders()]


def is_placeholder(tensor) -> bool:
    """True for a tensor that has no device buffer (a placeholder)."""
    return (isinstance(tensor, torch.Tensor) and tensor.device.type == "xla"
            and bool(_XLAC._is_placecholder(tensor)))


def placeholder_id(tensor) -> int:
    """The process-unique id the C++ core gave the placeholder `tensor`."""
    data = getattr(tensor, "_placeholder_data", None)
    if data is None or not is_placeholder(tensor):
        what = (f"a {_describe_shape(tensor)} tensor" if isinstance(tensor, torch.Tensor)
                else f"a {type(tensor).__name__}")
        raise ValueError(f"placeholder_id() takes a placeholder made by "
                         f"torch_xla_ext.placeholder(), got {what}")
    return data.id


def depends_on_placeholder(tensor: torch.Tensor) -> bool:
    """True when computing `tensor` would read a placeholder."""
    if tensor.device.type != "xla":
        return False
    if _XLAC._is_placecholder(tensor):
        return True
    _, data_tensors = _XLAC._get_tensors_xla_device_data_node([tensor])
    return any(_XLAC._is_placecholder(d) for d in data_tensors)


@contextlib.contextmanager
def tracing(what: str):
    """Marks a region where a function is traced with placeholders: syncing in
    it raises `PlaceholderError` naming `what`."""
    _install_sync_guard()
    previous = getattr(_tracing_state, "what", None)
    _tracing_state.what = what
    try:
        yield
    finally:
        _tracing_state.what = previous


def is_tracing() -> bool:
    """Whether this thread is inside `tracing` (scan is tracing a function)."""
    return tracing_what() is not None


def tracing_what() -> str | None:
    """What this thread's `tracing` traces ("scan's fn 'step'"), or None."""
    return getattr(_tracing_state, "what", None)


# ---------------------------------------------------------------------------
# Argument checks

def _check_sizes(shape) -> list[int]:
    if isinstance(shape, (int, torch.SymInt)) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (Sequence, torch.Size)) or isinstance(shape, (str, bytes)):
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}")
    sizes = []
    for dim, size in enumerate(shape):
        if isinstance(size, bool) or not hasattr(size, "__index__"):
            raise TypeError(f"shape[{dim}] must be an int, got {size!r} in shape {tuple(shape)!r}")
        size = operator.index(size)
        if size < 0:
            raise ValueError(f"shape[{dim}] must be non-negative, got {size} in shape {tuple(shape)!r}")
        sizes.append(size)
    return sizes


def _check_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"dtype {dtype} is not supported by torch_xla placeholders; use one of {names}")


def _check_device(device) -> int:
    default = torch_xla.device()
    if device is None:
        return default.index or 0
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise TypeError(f"device must be a torch.device or a device string, got {device!r}") from error
    if device.type != "xla":
        raise ValueError(f"device must be an XLA device such as {default}, got {device}; "
                         f"placeholders exist only on XLA devices")
    if device.index not in (None, default.index):
        raise ValueError(f"placeholders are created on the default XLA device {default}, "
                         f"got {device}; select it with torch_xla.device({device.index}) first")
    return default.index or 0


# ---------------------------------------------------------------------------
# Marking derived tensors

# Keyed by id(): a WeakSet would compare tensors with ==, which is elementwise.
_live_derived: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
_tracing_state = threading.local()


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
            _live_derived[id(leaf)] = leaf


_IN_PLACE_DUNDERS = frozenset(["__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"])


def _mutates_arguments(func) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_DUNDERS


def _leaves_xla(func, args, kwargs) -> bool:
    """Whether a `to`/`copy_`/`__setitem__` call would put XLA data on the host."""
    if func is torch.Tensor.copy_ or func is torch.Tensor.__setitem__:
        return args[0].device.type != "xla"
    for value in list(args[1:]) + [kwargs.get("device")]:
        if isinstance(value, (str, torch.device)):
            return torch.device(value).type != "xla"
        if isinstance(value, torch.Tensor):
            return value.device.type != "xla"
    return False


def _backward_marking_gradients(func, args, kwargs, sources: tuple):
    """Runs a backward pass and marks the gradients it accumulates, which
    depend on the placeholders the graph read."""
    roots = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    leaves = list(_accumulating_leaves(t.grad_fn for t in roots))
    with torch._C.DisableTorchFunctionSubclass(), DataReadGuard(sources, func):
        result = func(*args, **kwargs)
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


# ---------------------------------------------------------------------------
# Reading values

def _raise_if_value_missing(args, kwargs, func) -> None:
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, PlaceholderTensor) and depends_on_placeholder(leaf):
            raise PlaceholderError(_missing_value_message(leaf, func))


def _describe_shape(tensor: torch.Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}[{','.join(str(s) for s in tensor.shape)}]"


def _describe_sources(tensor) -> str:
    sources = getattr(tensor, "_placeholder_sources", ())
    if not sources:
        return "placeholders"
    return ", ".join(data.describe() for data in sources)


def _missing_value_message(tensor, func) -> str:
    action = getattr(func, "__name__", str(func))
    data = getattr(tensor, "_placeholder_data", None)
    if getattr(tensor, "_placeholder_discarded", False):
        subject = f"a {_describe_shape(tensor)} tensor computed from {_describe_sources(tensor)}"
        why = ("its pending computation was discarded when torch_xla synced, because it reads "
               "placeholders, which have no data")
    elif data is not None and _XLAC._is_placecholder(tensor):
        subject = data.describe()
        why = "a placeholder has a shape and a dtype but no data"
    else:
        subject = f"a {_describe_shape(tensor)} tensor computed from {_describe_sources(tensor)}"
        why = "it reads placeholders, which have a shape and a dtype but no data"
    traced = getattr(_tracing_state, "what", None)
    if traced is not None:
        return (f"cannot read the value of {subject} (via {action}) while {traced} is traced "
                f"with placeholders: a scanned function cannot read data; {why}. Keep values "
                f"on the device (use torch ops instead of .item(), .cpu() or printing).")
    return (f"cannot read the value of {subject} (via {action}): {why}. Placeholders only stand "
            f"for inputs while a computation is traced or lowered; run it with real tensors to "
            f"get values (for example through torch_xla_ext.scan).")


# ---------------------------------------------------------------------------
# Ops that read data on the way

_DATA_DEPENDENT_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
# Kernels that run on the XLA device; an op with none of them goes to
# torch_xla's CPU fallback, which copies its inputs to the host.
_DEVICE_KERNEL_KEYS = ("XLA", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")
# torch_xla 2.9.0 kernels that copy their input to the host though torch does
# not tag them (to check it, or to compute part of the result there): found
# by running every op with an XLA kernel on real tensors and watching for
# device-to-host transfers, which test_placeholder_data_reads does again.
# multinomial does only when it draws several samples without replacement.
HOST_READING_XLA_KERNELS = frozenset(
    ["aten::linalg_qr", "aten::mvlgamma", "aten::rrelu_with_noise_functional"])
_HOST_READING_REASON = "torch_xla's kernel for it reads the data on the host"
_MASK_DTYPES = (torch.bool, torch.uint8)


@functools.cache
def data_read_reason(op: torch._ops.OpOverload) -> str | None:
    """Why running `op` on XLA tensors reads their data whatever its
    arguments, or None if it does not: its output's shape or value depends on
    the data (torch tags such ops; indexing is tagged for its boolean masks
    alone, see `_reads_data`), torch_xla's kernel reads it on the host, or
    torch_xla has no device kernel for it and runs it on the CPU."""
    if any(tag in op.tags for tag in _DATA_DEPENDENT_TAGS) and indices_position(op) is None:
        return "its output's shape depends on the data"
    if op.name() in HOST_READING_XLA_KERNELS:
        return _HOST_READING_REASON
    if not torch._C._dispatch_has_kernel(op.name()):
        return None  # not a dispatcher op (prim::device reads a tensor's metadata only)
    if not any(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)
               for key in _DEVICE_KERNEL_KEYS):
        return "torch_xla has no XLA kernel for it and runs it on the CPU, which reads the data"
    return None


@functools.cache
def indices_position(op: torch._ops.OpOverload) -> int | None:
    """The position of an indexing op's list of optional index tensors
    (`aten.index`, `index_put`, ...), or None for other ops."""
    for position, argument in enumerate(op._schema.arguments):
        if (argument.name == "indices" and isinstance(argument.type, torch._C.ListType)
                and "Tensor" in str(argument.type.getElementType())):
            return position
    return None


def _reads_data(op: torch._ops.OpOverload, args, kwargs) -> str | None:
    """Why this call of `op` reads its inputs' data, or None: `data_read_reason`,
    and the ops that read it for some arguments only."""
    reason = data_read_reason(op)
    position = indices_position(op)
    if reason is None and position is not None:
        # torch_xla finds a boolean mask's positions with nonzero; integer
        # indices need no data.
        indices = args[position] if position < len(args) else kwargs.get("indices", ())
        if any(isinstance(index, torch.Tensor) and index.dtype in _MASK_DTYPES
               for index in indices):
            return ("it indexes by a boolean mask, whose positions torch_xla finds with "
                    "nonzero, an op whose output's shape depends on the data")
    if op is torch.ops.aten.multinomial.default:
        # It checks on the host that there are enough categories to draw from.
        replacement = args[2] if len(args) > 2 else kwargs.get("replacement", False)
        if args[1] > 1 and not replacement:
            return _HOST_READING_REASON
    return reason


class DataReadGuard(TorchDispatchMode):
    """Raises `PlaceholderError` for an ATen op that would read the data of a
    tensor computed from placeholders, before torch_xla runs it: torch_xla
    2.9.0 executes such an op's inputs at once (to learn a shape, or to run it
    on the CPU), and executing a graph that reads a placeholder kills the
    process. Active while a `PlaceholderTensor` op runs: `caller` (the
    function called on it) and its placeholders `sources` are for the message."""

    def __init__(self, sources: tuple, caller):
        super().__init__()
        self.sources = sources
        self.caller = caller

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _reads_data(func, args, kwargs)
        if reason is not None:
            reading = [leaf for leaf in tree_flatten((args, kwargs))[0]
                       if isinstance(leaf, torch.Tensor) and depends_on_placeholder(leaf)]
            if reading:
                raise PlaceholderError(
                    _data_read_message(func, self.caller, reason, reading[0], self.sources))
        return func(*args, **kwargs)


def _data_read_message(op, caller, reason: str, tensor: torch.Tensor, sources: tuple) -> str:
    named = ", ".join(data.describe() for data in sources[:2]) or "placeholders"
    if len(sources) > 2:
        named += f" and {len(sources) - 2} more"
    subject = f"a {_describe_shape(tensor)} tensor computed from {named}"
    name = op.name().replace("::", ".")
    # The function called, when it is not the op itself (x[mask] is
    # __getitem__ running aten.index; argwhere runs aten.nonzero).
    caller_name = getattr(caller, "__name__", str(caller)).partition(".")[0]
    if caller_name != op._schema.name.partition("::")[2]:
        name += f" (called by {caller_name})"
    where = _user_line()
    traced = tracing_what()
    if traced is not None:
        return (f"{traced} calls {name}{where} on {subject}: {reason}, and scan traces fn "
                f"once from shapes alone, with placeholders, which have no data. Give the "
                f"step static shapes (torch.where(mask, x, 0) instead of x[mask], a fixed "
                f"number of items with topk), or run this code outside the scan.")
    return (f"cannot run {name}{where} on {subject}: {reason}, and placeholders have a shape "
            f"and a dtype but no data. Run it on real tensors, or use an op of static shape.")


# Code that is not the user's: the libraries the op went through, and Python's own.
_LIBRARY_DIRS = tuple(os.path.dirname(module.__file__) + os.sep for module in (torch, torch_xla)) + (
    os.path.dirname(__file__) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep)


def _user_line() -> str:
    """' at FILE:LINE (`source`)' for the innermost frame of the stack that is
    not in torch, torch_xla, torch_xla_ext or the standard library: the line
    that called the op, for the message."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_LIBRARY_DIRS):
            source = f" (`{frame.line}`)" if frame.line else ""
            return f" at {frame.filename}:{frame.lineno}{source}"
    return ""


# ---------------------------------------------------------------------------
# Guarding torch_xla's sync entry points

def _discard_pending_placeholder_work() -> None:
    traced = tracing_what()
    if traced is not None:
        raise PlaceholderError(
            f"cannot sync while {traced} is traced with placeholders: a traced function "
            f"must not read data or run the device (no torch_xla.sync(), .item(), .cpu())")
    discarded = []
    # valuerefs() copies the references at once, so that threads making
    # placeholders meanwhile cannot change what is being iterated.
    for ref in _live_derived.valuerefs():
        tensor = ref()
        if (tensor is not None and not _XLAC._is_placecholder(tensor)
                and depends_on_placeholder(tensor)):
            _replace_with_placeholder(tensor)
            discarded.append(tensor)
    if discarded:
        warnings.warn(
            f"torch_xla sync: discarded {len(discarded)} pending computation(s) that read "
            f"placeholders, e.g. a {_describe_shape(discarded[0])} tensor computed from "
            f"{_describe_sources(discarded[0])}; placeholders have no data, so these cannot run. "
            f"Reading them raises PlaceholderError.", RuntimeWarning, stacklevel=4)


def _replace_with_placeholder(tensor: torch.Tensor) -> None:
    if tensor.grad_fn is not None and not tensor._is_view():
        tensor.detach_()  # frees the autograd graph, whose saved tensors read placeholders too
    replacement = _registered_placeholder(list(tensor.shape), tensor.dtype,
                                          tensor.device.index or 0)
    with torch._C.DisableTorchFunctionSubclass():
        tensor.data = replacement
    tensor._placeholder_data = replacement._placeholder_data
    tensor._placeholder_discarded = True


def _guard(sync_entry_point):
    def guarded(*args, **kwargs):
        _discard_pending_placeholder_work()
        return sync_entry_point(*args, **kwargs)

    guarded.__name__ = sync_entry_point.__name__
    guarded.__wrapped__ = sync_entry_point
    return guarded


SYNC_ENTRY_POINTS = ("_xla_step_marker", "_xla_sync_multi", "_xla_sync_live_tensors")
_sync_guard_lock = threading.Lock()
_sync_guard_installed = False


def _install_sync_guard() -> None:
    """Wraps torch_xla's sync entry points, once per process. Until a
    placeholder exists there is nothing to guard, so this runs on the first
    one, not at import."""
    global _sync_guard_installed
    if _sync_guard_installed:
        return
    with _sync_guard_lock:
        if _sync_guard_installed:
            return
        # torch_xla's Python layer calls these through the _XLAC module at call
        # time, so wrapping them there covers torch_xla.sync(), xm.mark_step(),
        # optimizer barriers and explicit tensor syncs alike.
        for name in SYNC_ENTRY_POINTS:
            setattr(_XLAC, name, _guard(getattr(_XLAC, name)))
        _sync_guard_installed = True
