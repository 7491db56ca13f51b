"""What this package adds to torch's scan operator on XLA tensors, and which
calls of it go where: the one change this package makes to torch.

Installed once per process, by the first `register_torch_scan` or compilation
with `openxla_scan` (never by an import), and kept: a later registration or
unregistration only changes the options the kernel reads (`active`).

The dispatch keys, and why:

- `AutogradXLA`: the operator's autograd kernel for XLA tensors, which comes
  before torch's own (registered at the `Autograd` alias key). A call on XLA
  tensors thus reaches `scan` with the tensors the caller holds (torch_xla's
  functional wrappers), and `scan`'s autograd Function records the backward:
  its While loop and its activation policy. At the `XLA` key, torch's autograd
  kernel would run first (with its own backward), and functionalization would
  hand over unwrapped tensors, which torch_xla cannot trace.
- `AutocastXLA` falls through: torch has no autocast rule for the operator on
  XLA, so under `torch.autocast("xla")` a call found no kernel. Falling through,
  the step's ops are cast as a for loop's are (under `torch.autocast`, `scan`
  traces its step with the caller's autocast state).
- `XLA`, reached past the autograd keys: with real tensors only under
  `torch.inference_mode` (which skips the autograd keys) or below torch's own
  autograd kernel. It runs torch's own kernel (unrolled: `scan` cannot trace
  the unwrapped tensors functionalization hands over there), with a
  `TorchScanWarning` if registered.

Which calls reaching `AutogradXLA` go where (`_route`), and why:

- A call being traced rather than run (a tensor argument with Python dispatch,
  FakeTensor or FunctionalTensor, or a dispatch mode torch's operator has a
  rule for: Dynamo's, `torch.export`'s and AOTAutograd's tracing) goes to
  torch's own autograd kernel: the operator must stay one node of the traced
  graph, whatever runs the graph later. torch 2.9's rule drops the gradient
  that flows through a carry whose `init` leaf does not require grad (its
  backward step differentiates with respect to the carry only if `init`
  requires grad), so while registered, and while `openxla_scan` traces, such
  leaves are handed to it as fresh copies that require grad (whose own
  gradient nobody reads); copies, not detached views, since torch_xla's
  dynamo bridge miscounts a graph's outputs that share an input's data (an
  IndexError when it puts them back).
- Otherwise, registered: `scan` runs it (`translation`); unregistered:
  torch's own kernel, as if nothing were installed.
"""
from __future__ import annotations

import contextlib
import threading
import warnings

import torch
from torch._C import DispatchKey
from torch._higher_order_ops.scan import scan_op
from torch.utils._python_dispatch import _get_current_dispatch_mode

from torch_xla_ext.torch_scan.translation import LoopOptions, run_as_loop
from torch_xla_ext.diagnostics import TorchXlaExtWarning

_install_lock = threading.Lock()
# torch's own kernels, taken when installing.
_torch_autograd_kernel = None
_torch_dense_kernel = None
_active: LoopOptions | None = None
_compiling = threading.local()  # .depth: nesting of tracing_for_backend


class TorchScanWarning(TorchXlaExtWarning):
    """What `register_torch_scan` asked for does not happen: a call of torch's
    scan operator ran unrolled, or a compiled graph cannot apply its policy."""


def active() -> LoopOptions | None:
    """The registration's options, or None when unregistered."""
    return _active


def set_active(options: LoopOptions | None) -> None:
    """Registers with `options` (installing first), or unregisters (None)."""
    global _active
    if options is not None:
        install()
    _active = options


@contextlib.contextmanager
def tracing_for_backend():
    """While `openxla_scan` traces a graph: traced calls get carries that
    carry gradients (see the module's docstring)."""
    install()
    _compiling.depth = getattr(_compiling, "depth", 0) + 1
    try:
        yield
    finally:
        _compiling.depth -= 1


def install() -> None:
    """Adds the `AutogradXLA` and `XLA` kernels and the `AutocastXLA`
    fall-through to torch's scan operator, once per process."""
    global _torch_autograd_kernel, _torch_dense_kernel
    with _install_lock:
        if _torch_autograd_kernel is not None:
            return
        _torch_autograd_kernel = scan_op.py_kernels[DispatchKey.Autograd]
        _torch_dense_kernel = scan_op.py_kernels[DispatchKey.CompositeExplicitAutograd]
        scan_op.py_impl(DispatchKey.AutogradXLA)(_autograd_xla)
        scan_op.py_impl(DispatchKey.XLA)(_xla)
        scan_op.non_fallthrough_keys = scan_op.non_fallthrough_keys - _autocast_xla_keys()


def _autocast_xla_keys() -> torch._C.DispatchKeySet:
    """{AutocastXLA}, which torch's Python enum does not name: the autocast key
    `torch.autocast("xla")` takes out of the thread's excluded keys."""
    outside = torch._C._dispatch_tls_local_exclude_set()
    with torch.autocast("xla"):
        inside = torch._C._dispatch_tls_local_exclude_set()
    return outside - inside


def _autograd_xla(combine_fn, init, xs, additional_inputs):
    return _route(combine_fn, init, xs, additional_inputs)(
        combine_fn, init, xs, additional_inputs)


def _route(combine_fn, init, xs, additional_inputs):
    """The kernel this call runs (the one decision; the module's docstring
    gives the reasons)."""
    tensors = [t for t in (*init, *xs, *additional_inputs) if isinstance(t, torch.Tensor)]
    if _traced(tensors):
        if _active is not None or getattr(_compiling, "depth", 0):
            return _torch_rule_with_differentiable_carries
        return _torch_autograd_kernel
    if _active is None:
        return _torch_autograd_kernel
    options = _active
    return lambda *call: run_as_loop(*call, options)


def _traced(tensors) -> bool:
    mode = _get_current_dispatch_mode()
    return ((mode is not None and type(mode) in scan_op.python_key_table)
            or any(torch._C._dispatch_keys(t).has(DispatchKey.Python) for t in tensors))


def _torch_rule_with_differentiable_carries(combine_fn, init, xs, additional_inputs):
    operands = [t for t in (*init, *xs, *additional_inputs) if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in operands):
        init = [t.detach().clone().requires_grad_()
                if t.dtype.is_floating_point and not t.requires_grad else t for t in init]
    return _torch_autograd_kernel(combine_fn, init, xs, additional_inputs)


def _xla(combine_fn, init, xs, additional_inputs):
    if _active is not None:
        warnings.warn(
            "torch's scan operator ran unrolled, as torch's own kernel, though "
            "register_torch_scan is in effect: the call skipped the autograd dispatch key, "
            "where the registration runs it as one loop (torch.inference_mode skips it); run "
            "it under torch.no_grad() instead of inference mode", TorchScanWarning, stacklevel=2)
    return _torch_dense_kernel(combine_fn, init, xs, additional_inputs)
