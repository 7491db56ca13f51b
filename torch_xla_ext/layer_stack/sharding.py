"""FSDPv2 (torch_xla's `SpmdFullyShardedDataParallel`) around modules that hold
layer stacks.

FSDPv2 shards each parameter of the module it wraps along the parameter's
largest dimension. For a stacked `[L, ...]` parameter that may be the layer
dimension (L layers of norm weights `[L, d]` with `d <= L`, a per-layer scalar
`[L, 1]`), which the scan slices at every step. So the first `LayerStack`
made in a process teaches FSDPv2 (at once if it is imported, else when it is)
to shard first each stacked parameter of the module it wraps as it would
shard one layer's parameter (along that one's largest dimension), never along
the layer dimension; its own loop then leaves them, as it shards only what
has no sharding yet.
"""
from __future__ import annotations

import functools

import torch
import torch_xla
from torch import nn

from torch_xla_ext.on_import import when_imported

FSDP_V2_MODULE = "torch_xla.experimental.spmd_fully_sharded_data_parallel"


def teach_fsdp_v2() -> None:
    """Teaches FSDPv2 (above), once per process."""
    when_imported(FSDP_V2_MODULE, _teach)


def _teach() -> None:
    import torch_xla.distributed.spmd as spmd
    from torch_xla.experimental import spmd_fully_sharded_data_parallel as fsdp_v2

    from torch_xla_ext.layer_stack.stack import LayerStack

    wrapper_class = fsdp_v2.SpmdFullyShardedDataParallel
    init = wrapper_class.__init__

    @functools.wraps(init)
    def __init__(self, module, *args, mesh=None, **kwargs):
        stacks = ([each for each in module.modules() if isinstance(each, LayerStack)]
                  if isinstance(module, nn.Module) else [])
        sharding_mesh = spmd.get_global_mesh() if mesh is None else mesh
        # Not a module, a module wrapped already, or no usable mesh: FSDPv2's
        # own checks raise, before anything is sharded.
        if (stacks and not isinstance(module, wrapper_class) and sharding_mesh is not None
                and "fsdp" in sharding_mesh.axis_names):
            module.to("xla")  # as FSDPv2 does before sharding: only XLA tensors are sharded
            for stack in stacks:
                _shard_stacked_parameters(stack, sharding_mesh, fsdp_v2)
        init(self, module, *args, mesh=mesh, **kwargs)

    wrapper_class.__init__ = __init__


def _shard_stacked_parameters(stack, mesh, fsdp_v2) -> None:
    """Shards each stacked parameter of `stack` that has no sharding yet as
    FSDPv2 (module `fsdp_v2`) shards one layer's parameter, with the layer
    dimension whole."""
    import torch_xla.distributed.spmd as spmd

    for param in stack.stacked.parameters():
        if torch_xla._XLAC._get_xla_sharding_spec(param) != "":
            continue
        one_layer = torch.empty(param.shape[1:], device="meta")
        spec = fsdp_v2._prepare_spmd_partition_spec(one_layer, shard_maximal=True)
        spmd.mark_sharding(param, mesh, (None, *spec))
