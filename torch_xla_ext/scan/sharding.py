"""SPMD: the shardings a loop keeps, and `mark_sharding` inside a scanned `fn`.

A loop keeps its operands' shardings. XLA's sharding propagation gives a
While loop's state one sharding for every iteration, chosen from the loop's
body more than from its operands, and across the loop's boundary it is
weaker than across unrolled layers: a batch-sharded hidden state came out
of a loop of Llama layers split on the hidden dimension (each norm's weight
is), with every saved activation whole on every device. So each step
constrains what it hands back to the loop as the loop's operands outside
are sharded (`operand_specs`, part of a trace's cache key): a carry as its
`init`, a gradient as the input it is the gradient of (an x slice as its xs
leaf without the leading dimension, `spec_sharding(spec, leading_dropped=True)`);
the While loop's state then has that sharding on the way in too, and the
values computed from it follow it as they do in the unrolled layers. Under
data parallelism the activations the forward loop stacks for the backward
loop are pinned too (`data_parallel_devices`, `split_along`; which
dimension holds the batch: `batch_dims`), since XLA chooses each loop's
state apart. An operand with no sharding of its own constrains nothing.

While AOTAutograd traces `fn` with fake tensors, torch_xla's in-place
`mark_sharding` becomes a functional `sharding_constraint` op in the graph,
applied when the graph is lowered. That takes one process-wide change, a
redirect of `torch_xla._XLAC._xla_mark_sharding`
(`torch_xla_ext.patches.torch_xla.redirect_mark_sharding`): installed by the
first SPMD trace that needs it, and a plain pass-through except on a thread
inside `functional_mark_sharding`, so threads tracing at the same time never
undo each other's redirect. The shardings graphs refer to are
interned by their serialized form, so the registry holds one entry per
distinct sharding, however many traces there are.
"""
from __future__ import annotations

import contextlib
import functools
import math
import re
import threading
from typing import Sequence

import numpy as np
import torch
import torch_xla
import torch_xla.runtime
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils._python_dispatch import _disable_current_modes

from torch_xla_ext.patches.torch_xla import redirect_mark_sharding

_XLAC = torch_xla._XLAC


def as_fn_arguments(stand_ins: Sequence[torch.Tensor]) -> list:
    """What fn receives for its stand-ins. Under SPMD, `stand_in + 0`: torch_xla's
    mark_sharding on device data shards (uploads) the data, which a placeholder
    lacks; on any other value it only annotates. XLA removes the addition."""
    if not torch_xla.runtime.is_spmd():
        return list(stand_ins)
    return [t if t.dtype == torch.bool else t + 0 for t in stand_ins]


def operand_specs(tensors: Sequence[torch.Tensor]) -> tuple[str, ...]:
    """Each tensor's sharding as torch_xla reports it ("{devices=[8,1]0,...}",
    "" for none; all "" off SPMD): a loop's operands', in a trace's cache key."""
    if not torch_xla.runtime.is_spmd():
        return ("",) * len(tensors)
    return tuple(_XLAC._get_xla_sharding_spec(t) for t in tensors)


def unsharded_specs(tensors: Sequence[torch.Tensor]) -> tuple[str, ...]:
    """`operand_specs` as for tensors of no sharding: a loop given them keeps
    none, and XLA propagates its operands' shardings through it."""
    return ("",) * len(tensors)


# "{devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}", or the devices
# as an iota "<=[4,2]T(1,0)".
_TILED = re.compile(r"^\{devices=\[([\d,]+)\](?:([\d,]+)|<=\[([\d,]+)\](?:T\(([\d,]+)\))?)"
                    r"( last_tile_dim_replicate)?\}$")


def _tiles(spec: str) -> tuple[list[int], np.ndarray, bool] | None:
    """A tiled spec's tiles per dimension, its devices in order, and whether
    its last tile dimension holds copies; None for another spec."""
    found = _TILED.match(spec)
    if found is None:
        return None
    tiles_text, listed, iota, permutation, replicated_last = found.groups()
    if listed:
        devices = np.array([int(n) for n in listed.split(",")])
    else:
        reshaped = [int(n) for n in iota.split(",")]
        order = [int(n) for n in permutation.split(",")] if permutation else range(len(reshaped))
        devices = np.arange(math.prod(reshaped)).reshape(reshaped).transpose(order).ravel()
    return [int(n) for n in tiles_text.split(",")], devices, bool(replicated_last)


@functools.lru_cache(maxsize=256)
def spec_sharding(spec: str, leading_dropped: bool = False):
    """The OpSharding torch_xla's `spec` (`operand_specs`) stands for, or,
    with `leading_dropped`, that of one slice along the leading dimension
    (the devices that held other slices holding copies). None for no
    sharding, or one this does not read (maximal, manual), which then
    constrains nothing."""
    from torch_xla.distributed.spmd import Mesh
    from torch_xla.distributed.spmd.xla_sharding import ShardingType

    if spec == "{replicated}":
        return _XLAC.OpSharding([], [], [], ShardingType.REPLICATED)
    parsed = _tiles(spec)
    if parsed is None:
        return None
    tiles, devices, replicated_last = parsed
    tile_array = devices.reshape(tiles)
    if not replicated_last:  # one copy of each tile: a replication dimension of 1
        tile_array = tile_array[..., np.newaxis]
    if leading_dropped:  # the leading dimension's devices join the copies
        tile_array = np.moveaxis(tile_array, 0, -2)
        tile_array = tile_array.reshape(*tile_array.shape[:-2], -1)
    rank = tile_array.ndim - 1
    if rank == 0 or tile_array.shape[-1] == devices.size:
        return _XLAC.OpSharding([], [], [], ShardingType.REPLICATED)
    axes = tuple(f"tiles{i}" for i in range(tile_array.ndim))
    if tile_array.shape[-1] == 1:
        mesh = Mesh(tile_array.ravel(), tile_array.shape[:-1], axes[:-1])
    else:
        mesh = Mesh(tile_array.ravel(), tile_array.shape, axes)
    return mesh.get_op_sharding(axes[:rank])


def data_parallel_devices(spec: str) -> tuple[int, ...] | None:
    """The devices, in order, when `spec` splits a tensor's leading dimension
    alone, one part on each device (data parallelism); else None."""
    parsed = _tiles(spec)
    if parsed is None:
        return None
    tiles, devices, replicated_last = parsed
    if replicated_last or tiles[0] != devices.size or devices.size < 2:
        return None
    return tuple(int(device) for device in devices)


def split_along(devices: Sequence[int], rank: int, dim: int):
    """The OpSharding that splits dimension `dim` of a rank-`rank` value over
    `devices`, in their order."""
    tiles = [len(devices) if d == dim else 1 for d in range(rank)]
    return spec_sharding(f"{{devices=[{','.join(map(str, tiles))}]"
                         f"{','.join(map(str, devices))}}}")


def constrained(tensors: Sequence[torch.Tensor], shardings: Sequence) -> list:
    """`tensors` (lazy tensors: a step's values before it is lowered, a
    scan's operands), each constrained to its OpSharding (`spec_sharding`);
    None leaves its tensor."""
    result = []
    for tensor, sharding in zip(tensors, shardings):
        if sharding is not None:
            # A new value, so that the constraint is on it and not on the trace's
            # tensor; not a clone, which of device data (a placeholder stand-in)
            # is device data, which torch_xla's mark_sharding would upload.
            tensor = tensor ^ False if tensor.dtype == torch.bool else tensor + 0
            _mark_sharding_in_place(tensor, sharding)
        result.append(tensor)
    return result


# torch_xla's own mark_sharding, taken before any redirect.
_mark_sharding_in_place = _XLAC._xla_mark_sharding
# Shardings that traced graphs refer to (an OpSharding is not a value a graph
# can hold), by their serialized form ("{devices=[4,1]0,1,2,3}").
_traced_shardings: dict[str, object] = {}
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


@contextlib.contextmanager
def functional_mark_sharding():
    """While AOTAutograd traces fn with fake tensors on this thread,
    mark_sharding (an in-place annotation that fake tensors cannot take)
    becomes a functional `sharding_constraint` op in the graph."""
    if not torch_xla.runtime.is_spmd():
        yield
        return
    redirect_mark_sharding(_redirected_mark_sharding)
    _thread_state.depth = getattr(_thread_state, "depth", 0) + 1
    try:
        yield
    finally:
        _thread_state.depth -= 1
