"""SPMD: `mark_sharding` inside a scanned `fn`."""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch_xla
import torch_xla.runtime
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

_XLAC = torch_xla._XLAC


def as_fn_arguments(stand_ins: Sequence[torch.Tensor]) -> list:
    """What fn receives for its stand-ins. Under SPMD, `stand_in + 0`: torch_xla's
    mark_sharding on device data shards (uploads) the data, which a placeholder
    lacks; on any other value it only annotates. XLA removes the addition."""
    if not torch_xla.runtime.is_spmd():
        return list(stand_ins)
    return [t if t.dtype == torch.bool else t + 0 for t in stand_ins]


_mark_sharding_in_place = _XLAC._xla_mark_sharding
# Shardings that AOTAutograd-traced graphs refer to by index (an OpSharding is
# not a value a graph can hold).
_traced_shardings: list = []


@torch.library.custom_op("torch_xla_ext::sharding_constraint", mutates_args=())


def _sharding_constraint(tensor: torch.Tensor, sharding: int) -> torch.Tensor:
    annotated = tensor.clone()
    _mark_sharding_in_place(annotated, _traced_shardings[sharding])
    return annotated


@_sharding_constraint.register_fake


def _(tensor, sharding):
    return torch.empty_like(tensor)


_sharding_constraint.register_autograd(lambda ctx, grad: (grad, None))


@contextlib.contextmanager


def functional_mark_sharding():
    """While AOTAutograd traces fn with fake tensors, mark_sharding (an in-place
    annotation that fake tensors cannot take) becomes a functional
    `sharding_constraint` op in the graph, applied when the graph is lowered."""
    if not torch_xla.runtime.is_spmd():
        yield
        return

    def mark(tensor, sharding):
        if not isinstance(tensor, (FakeTensor, FunctionalTensor)):
            return _mark_sharding_in_place(tensor, sharding)
        _traced_shardings.append(sharding)
        tensor.copy_(torch.ops.torch_xla_ext.sharding_constraint(tensor, len(_traced_shardings) - 1))

    _XLAC._xla_mark_sharding = mark
    try:
        yield
    finally:
        _XLAC._xla_mark_sharding = _mark_sharding_in_place

