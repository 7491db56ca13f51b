"""The sync guard: torch_xla executes pending work at a sync, and executing
work that reads a placeholder kills the process (torch_xla 2.9.0). So each
of torch_xla's sync entry points (`torch_xla_ext.patches.torch_xla.guard_syncs`)
first discards the pending work that reads placeholders: its tensors become
value-less placeholders themselves, so the sync runs the rest and later
reads raise `PlaceholderError`. While `scan` traces a function
(`tracing`), syncing raises `PlaceholderError` instead.

The guard is installed by the first placeholder or `tracing` region
(`guard_syncs`), never at import, and never undone: placeholders may live
as long as the process.
"""
from __future__ import annotations

import contextlib
import threading
import warnings

import torch
import torch_xla

from torch_xla_ext.diagnostics import TorchXlaExtWarning
from torch_xla_ext.patches import torch_xla as torch_xla_patches
from torch_xla_ext.placeholders.registry import (
    PlaceholderError, depends_on_placeholder, describe_shape, describe_sources, live_derived,
    registered_placeholder)

_XLAC = torch_xla._XLAC


class DiscardedComputationWarning(TorchXlaExtWarning, RuntimeWarning):
    """A sync dropped pending computations that read placeholders: they have
    no data to run on."""


_tracing_state = threading.local()  # .what: what this thread's `tracing` traces


@contextlib.contextmanager
def tracing(what: str):
    """Marks a region where a function is traced with placeholders: syncing in
    it raises `PlaceholderError` naming `what`."""
    guard_syncs()
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


def guard_syncs() -> None:
    """Installs the sync guard (above), once per process."""
    torch_xla_patches.guard_syncs(_discard_pending_placeholder_work)


def _discard_pending_placeholder_work() -> None:
    traced = tracing_what()
    if traced is not None:
        raise PlaceholderError(
            f"cannot sync while {traced} is traced with placeholders: a traced function "
            f"must not read data or run the device (no torch_xla.sync(), .item(), .cpu())")
    discarded = []
    for tensor in live_derived():
        if not _XLAC._is_placecholder(tensor) and depends_on_placeholder(tensor):
            _replace_with_placeholder(tensor)
            discarded.append(tensor)
    if discarded:
        # stacklevel: this function, the guarded entry point, torch_xla's sync, its caller.
        warnings.warn(
            f"torch_xla sync: discarded {len(discarded)} pending computation(s) that read "
            f"placeholders, e.g. a {describe_shape(discarded[0])} tensor computed from "
            f"{describe_sources(discarded[0])}; placeholders have no data, so these cannot run. "
            f"Reading them raises PlaceholderError.", DiscardedComputationWarning, stacklevel=4)


def _replace_with_placeholder(tensor: torch.Tensor) -> None:
    if tensor.grad_fn is not None and not tensor._is_view():
        tensor.detach_()  # frees the autograd graph, whose saved tensors read placeholders too
    replacement = registered_placeholder(list(tensor.shape), tensor.dtype,
                                         tensor.device.index or 0)
    # What an op computed below torch's functionalization (a composite op's
    # intermediate that a traceback holds) takes the unwrapped placeholder.
    data = (replacement if torch._is_functional_tensor(tensor)
            else torch._from_functional_tensor(replacement))
    with torch._C.DisableTorchFunctionSubclass():
        tensor.data = data
    tensor._placeholder_data = replacement._placeholder_data
    tensor._placeholder_discarded = True
