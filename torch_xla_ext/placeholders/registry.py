"""What a placeholder is: torch_xla's placeholder tensor carrying the C++
core's `PlaceholderData`, which gives it a process-unique id and the
description every message uses; the lists of placeholders and of tensors
computed from them that are alive; the checks of `placeholder()`'s arguments."""
from __future__ import annotations

import operator
import weakref
from typing import Iterator, NamedTuple, Sequence

import torch
import torch_xla
import torch_xla.core.xla_builder as xla_builder

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


def registered_placeholder(sizes: list[int], dtype: torch.dtype, ordinal: int) -> torch.Tensor:
    """Every placeholder torch_xla_ext makes comes from here: torch_xla's
    placeholder tensor, carrying (and keeping alive) the C++ core's
    `PlaceholderData` that gives it its id, as `_placeholder_data`. (The sync
    guard must be installed before one is handed out: `syncs.guard_syncs`.)"""
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
        what = (f"a {describe_shape(tensor)} tensor" if isinstance(tensor, torch.Tensor)
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


def describe_shape(tensor: torch.Tensor) -> str:
    """"float32[2,3]", as messages name a tensor."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}[{','.join(str(s) for s in tensor.shape)}]"


def describe_sources(tensor) -> str:
    """The placeholders `tensor` is computed from, as messages name them."""
    sources = getattr(tensor, "_placeholder_sources", ())
    if not sources:
        return "placeholders"
    return ", ".join(data.describe() for data in sources)


# The tensors computed from placeholders (and the placeholders `placeholder()`
# made) that are alive, which a sync looks through. Keyed by id(): a WeakSet
# would compare tensors with ==, which is elementwise.
_live_derived: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def track_derived(tensor: torch.Tensor) -> None:
    """Lists `tensor`, computed from placeholders, among the live ones."""
    _live_derived[id(tensor)] = tensor


def live_derived() -> Iterator[torch.Tensor]:
    """The tensors `track_derived` listed that are alive."""
    # valuerefs() copies the references at once, so that threads making
    # placeholders meanwhile cannot change what is being iterated.
    for ref in _live_derived.valuerefs():
        tensor = ref()
        if tensor is not None:
            yield tensor


# ---------------------------------------------------------------------------
# Argument checks

def check_sizes(shape) -> list[int]:
    """`shape` (an int or a sequence of them) as a list of sizes."""
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


def check_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"dtype {dtype} is not supported by torch_xla placeholders; use one of {names}")


def check_device(device) -> int:
    """The ordinal of the XLA device `device` (None: the default one)."""
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
