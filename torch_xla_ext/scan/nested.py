"""A nested scan: one called while another scan traces its fn.

It runs as a loop of its own in the outer step, a While loop in the outer
loop's body, so its step is compiled once whatever its length. Its fn is
traced and cached as at the top level, with the outer trace's torch function
modes set aside (the outer trace would lift the inner placeholders as its own
captures); its loops then run as `torch_xla_ext::scan_loop` ops of the outer
trace, which lifts the tensors they read and differentiates them as any op.

Where a loop of its own cannot be what the for loop would do, the nested
scan runs as its for loop, unrolled into the outer step (`inline`):
`unrolled_because` says when, as a `Refusal`, and `warn_unrolled` tells the
caller which of its switches that leaves without effect, as
`warn_no_step_cotangents` does for one that a nested scan never takes.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
from torch import overrides

from torch_xla_ext import policies
from torch_xla_ext.diagnostics import NestedScanWarning, Refusal


@contextlib.contextmanager
def outer_trace_set_aside():
    """Runs the block without the torch function modes of the outer trace
    (its `LiftCaptures`, and any around it), which are back after it."""
    modes = []
    while overrides._get_current_function_mode_stack():
        modes.append(overrides._pop_mode())
    try:
        yield
    finally:
        for mode in reversed(modes):
            overrides._push_mode(mode)


def fake_tensors_active() -> bool:
    """Whether ops now run on fake tensors (AOTAutograd differentiating the
    outer step), on which fn cannot be traced."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def unrolled_because(length: int, traced, cacheable: bool) -> Refusal | None:
    """Why a nested scan of `length` steps with this trace (None: no trace
    could be had) runs unrolled, or None when it runs as a loop of its own."""
    if length == 0:
        return Refusal("xs has 0 steps")
    if not cacheable:
        return Refusal("fn is traced at every call (is_fn_pure=False, or fn cannot be keyed), "
                       "and the outer step's differentiation calls it again on fake tensors")
    if traced is None:
        return Refusal("the outer step's differentiation called it with inputs of other "
                       "shapes or dtypes than the outer trace did, for which fn has no trace")
    if traced.uses_seed:
        return Refusal("fn draws random numbers (dropout): its loop's seeds are drawn at each "
                       "call, which would be once for every outer step")
    if traced.writes_back:
        return Refusal("fn writes in place to tensors it captures or to its xs slices, which "
                       "the outer trace carries only when it sees each write")
    return None


def warn_no_step_cotangents(fn) -> None:
    """Warns that a nested scan's `step_cotangents` has no effect."""
    warnings.warn(
        f"scan: the nested scan of {getattr(fn, '__qualname__', fn)!r} was given "
        f"step_cotangents, which has no effect in a nested scan: its backward is part of the "
        f"outer step's, which gives no cotangents of the inner steps' ys (retain_grad() on "
        f"what it returns gets only their own uses' gradient)", NestedScanWarning, stacklevel=3)


def warn_unrolled(refusal: Refusal, fn, partition_fn, unroll) -> None:
    """Warns when the caller gave the unrolled scan a switch of its own."""
    ignored = ([] if partition_fn is policies.save_everything else ["partition_fn"]) + (
        [] if unroll == 1 else ["unroll"])
    if ignored:
        warnings.warn(
            f"scan: the nested scan of {getattr(fn, '__qualname__', fn)!r} runs unrolled into "
            f"the outer step because {refusal.reason}; its {' and '.join(ignored)} "
            f"{'has' if len(ignored) == 1 else 'have'} no effect (the outer call's "
            f"partition_fn decides what its steps save)", NestedScanWarning, stacklevel=3)
