"""The guards on reads: reading the value of a tensor computed from
placeholders (`check_values`, for the Python functions that return data in
host memory), and ATen ops that read their inputs' data on the way
(`DataReadGuard`: ops whose output shape depends on the data, such as
`nonzero`, and ops torch_xla runs on the CPU), which in torch_xla 2.9.0 kill
the process. Each raises `PlaceholderError` naming the placeholders, the
op and the user's line."""
from __future__ import annotations

import functools
import os
import sysconfig
import traceback
from typing import Iterable

import torch
import torch_xla
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torch_xla_ext.patches.torch_xla import host_ops_lowered
from torch_xla_ext.placeholders.registry import (
    PlaceholderError, depends_on_placeholder, describe_shape, describe_sources)
from torch_xla_ext.placeholders.syncs import tracing_what

_XLAC = torch_xla._XLAC

# Tensor methods and functions whose result is the data itself, in host memory.
VALUE_READERS = frozenset([
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


def reads_value(func, args, kwargs) -> bool:
    """Whether calling `func` puts its XLA arguments' data in host memory."""
    return func in VALUE_READERS or (func in _DEVICE_MOVERS and _leaves_xla(func, args, kwargs))


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


def check_values(tensors: Iterable[torch.Tensor], func) -> None:
    """Raises `PlaceholderError` if one of `tensors`, whose values `func`
    reads, depends on a placeholder."""
    for tensor in tensors:
        if depends_on_placeholder(tensor):
            raise PlaceholderError(_missing_value_message(tensor, func))


def _missing_value_message(tensor, func) -> str:
    action = getattr(func, "__name__", str(func))
    data = getattr(tensor, "_placeholder_data", None)
    if getattr(tensor, "_placeholder_discarded", False):
        subject = f"a {describe_shape(tensor)} tensor computed from {describe_sources(tensor)}"
        why = ("its pending computation was discarded when torch_xla synced, because it reads "
               "placeholders, which have no data")
    elif data is not None and _XLAC._is_placecholder(tensor):
        subject = data.describe()
        why = "a placeholder has a shape and a dtype but no data"
    else:
        subject = f"a {describe_shape(tensor)} tensor computed from {describe_sources(tensor)}"
        why = "it reads placeholders, which have a shape and a dtype but no data"
    traced = tracing_what()
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


def data_read_reason(op: torch._ops.OpOverload) -> str | None:
    """Why running `op` on XLA tensors reads their data whatever its
    arguments, or None if it does not: its output's shape or value depends on
    the data (torch tags such ops; indexing is tagged for its boolean masks
    alone, see `_reads_data`), torch_xla's kernel reads it on the host, or
    torch_xla has no device kernel for it and runs it on the CPU (until
    torch_xla_ext gives it one: `patches.torch_xla.lower_host_ops`)."""
    return _data_read_reason(op, host_ops_lowered())


@functools.cache
def _data_read_reason(op: torch._ops.OpOverload, host_ops_lowered: bool) -> str | None:
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
    subject = f"a {describe_shape(tensor)} tensor computed from {named}"
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


# Code that is not the user's: the libraries the op went through (torch_xla_ext
# is this package's parent folder), and Python's own.
_LIBRARY_DIRS = tuple(os.path.dirname(path) + os.sep for path in (
    torch.__file__, torch_xla.__file__, os.path.dirname(__file__))) + (
    sysconfig.get_paths()["stdlib"] + os.sep,)


def _user_line() -> str:
    """' at FILE:LINE (`source`)' for the innermost frame of the stack that is
    not in torch, torch_xla, torch_xla_ext or the standard library: the line
    that called the op, for the message."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_LIBRARY_DIRS):
            source = f" (`{frame.line}`)" if frame.line else ""
            return f" at {frame.filename}:{frame.lineno}{source}"
    return ""
