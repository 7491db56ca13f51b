"""SPMD: `mark_sharding` inside a scanned `fn`.

While AOTAutograd traces `fn` with fake tensors, torch_xla's in-place
`mark_sharding` becomes a functional `sharding_constraint` op in the graph,
applied when the graph is lowered. That takes one process-wide patch, a
redirect of `torch_xla._XLAC._xla_mark_sharding`: installed (once, under a
lock) by the first SPMD trace that needs it, and a plain pass-through except
on a thread inside `functional_mark_sharding`, so threads tracing at the same
time never undo each other's redirect. The shardings graphs refer to are
interned by their serialized form, so the registry holds one entry per
distinct sharding, however many traces there are.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Sequence

import torch
import torch_xla
import torch_xla.runtime
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils._python_dispatch import _disable_current_modes

_XLAC = torch_xla._XLAC


def as_fn_arguments(stand_ins: Sequence[torch.Tensor]) -> list:
    """What fn receives for its stand-ins. Under SPMD, `stand_in + 0`: torch_xla's
    mark_sharding on device data shards (uploads) the data, which a placeholder
    lacks; on any other value it only annotates. XLA removes the addition."""
    if not torch_xla.runtime.is_spmd():
        return list(stand_ins)
    return [t if t.dtype == torch.bool else t + 0 for t in stand_ins]


# torch_xla's own mark_sharding, taken before any redirect.
_mark_sharding_in_place = _XLAC._xla_mark_sharding
# Shardings that traced graphs refer to (an OpSharding is not a value a graph
# can hold), by their serialized form ("{devices=[4,1]0,1,2,3}").
_traced_shardings: dict[str, object] = {}
_redirect_lock = threading.Lock()
_redirect_installed = False
_thread_state = threading.local()  # .depth: nesting of functional_mark_sharding


@torch.library.custom_op("torch_xla_ext::sharding_constraint", mutates_args=())
def _sharding_constraint(tensor: torch.Tensor, sharding: str) -> torch.Tensor:
    annotated = tensor.clone()
    _mark_sharding_in_place(annotated, _traced_shardings[sharding])
    return annotated


@_sharding_constraint.register_fake
def _(tensor, sharding):
    return torch.empty_like(tensor)


_sharding_constraint.register_autograd(lambda ctx, grad: (grad, None))


def _interned(tensor: torch.Tensor, sharding) -> str:
    """The serialized form of `sharding` for a tensor of `tensor`'s shape,
    registered so that the lowering finds the sharding again. torch_xla has
    no serializer for an OpSharding; a lazy tensor of that shape, annotated
    with it, reports its spec (no data is made or moved)."""
    with _disable_current_modes():  # the probe is no part of the traced graph
        probe = torch.zeros(tuple(tensor.shape), device=torch_xla.device())
    _mark_sharding_in_place(probe, sharding)
    spec = _XLAC._get_xla_sharding_spec(probe)
    _traced_shardings.setdefault(spec, sharding)  # atomic: racing threads keep one
    return spec


def _redirected_mark_sharding(tensor, sharding):
    if getattr(_thread_state, "depth", 0) and isinstance(tensor, (FakeTensor, FunctionalTensor)):
        spec = _interned(tensor, sharding)
        tensor.copy_(torch.ops.torch_xla_ext.sharding_constraint(tensor, spec))
        return None
    return _mark_sharding_in_place(tensor, sharding)


def _install_redirect() -> None:
    global _redirect_installed
    if _redirect_installed:
        return
    with _redirect_lock:
        if not _redirect_installed:
            # torch_xla's mark_sharding looks the function up on _XLAC at each call.
            _XLAC._xla_mark_sharding = _redirected_mark_sharding
            _redirect_installed = True


@contextlib.contextmanager
def functional_mark_sharding():
    """While AOTAutograd traces fn with fake tensors on this thread,
    mark_sharding (an in-place annotation that fake tensors cannot take)
    becomes a functional `sharding_constraint` op in the graph."""
    if not torch_xla.runtime.is_spmd():
        yield
        return
    _install_redirect()
    _thread_state.depth = getattr(_thread_state, "depth", 0) + 1
    try:
        yield
    finally:
        _thread_state.depth -= 1
