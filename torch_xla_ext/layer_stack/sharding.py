"""FSDP (torch_xla's `SpmdFullyShardedDataParallel`, FSDPv2, and its
auto-wrap policies) around modules that hold layer stacks.

FSDPv2 shards each parameter of the module it wraps along the parameter's
largest dimension. For a stacked `[L, ...]` parameter that may be the layer
dimension (L layers of norm weights `[L, d]` with `d <= L`, a per-layer scalar
`[L, 1]`), which the scan slices at every step. So the first `LayerStack`
made in a process teaches FSDPv2 (at once if it is imported, else when it is;
`torch_xla_ext.patches.torch_xla` makes the change) to shard first each stacked parameter of the module it wraps as it would
shard one layer's parameter (along that one's largest dimension), never along
the layer dimension; its own loop then leaves them, as it shards only what
has no sharding yet.

A unit per layer would also shard each layer's output on the batch (FSDPv2's
output sharding: the leading dimension on 'fsdp'). Across unrolled layers
XLA keeps that sharding by itself; a While loop's state is one sharding for
every layer, which XLA chose from the layers' weights (split on the hidden
dimension, every activation whole on every device). So the hidden state
each scan of a stack that FSDPv2 wraps carries (`entering`) is sharded as a
unit's output would be, and the scan keeps its carry's sharding at every
step (`torch_xla_ext.scan.sharding`): each layer's output is batch-sharded
inside the loop, as a unit's would be. (A unit's other addition, an
optimization barrier on each layer's gradients that keeps XLA from fusing
one layer's backward with the next's, the loop has by itself: each layer's
backward is one iteration.) A stack that FSDPv2 does not wrap gets the same
under SPMD from the global mesh (`xs.set_global_mesh`, as transformers'
Trainer sets it) when that has data axes ('data', 'fsdp', on which the data
loaders shard the inputs) and the hidden state has no sharding of its own:
across unrolled layers, XLA carries the inputs' batch sharding through.

A stack (a `LayerStack`, or the `StackedList` of a few) is never a unit of
its own: it runs its layers as one scan, and its `stacked` holder has no
forward for a unit to call. torch_xla's size-based policy (transformers'
`min_num_params`) keeps it whole, as it keeps `nn.ModuleList`s, for the unit
that holds it. An `auto_wrapper_callable` (transformers'
`xla_fsdp_grad_ckpt`, which checkpoints each unit) thus reaches stacked
layers only inside a unit that holds them, which a `ShardingWarning` says.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch_xla
import torch_xla.runtime
from torch import nn
from torch.utils._pytree import tree_map_only

from torch_xla_ext.layer_stack.storage import storage_of
from torch_xla_ext.patches.torch_xla import (
    keep_whole_in_auto_wrap, prepare_fsdp_v2, route_mark_sharding)
from torch_xla_ext.scan.sharding import constrained
from torch_xla_ext.diagnostics import TorchXlaExtWarning


class ShardingWarning(TorchXlaExtWarning):
    """A sharding request that stacked layers honour only in part."""


# The axes of a global mesh that hold parts of the batch, by torch_xla's
# names: FSDPv2 shards its inputs on 'fsdp', a data-parallel mesh names 'data'.
DATA_AXES = ("data", "fsdp")


def entering(unit_output, hidden):
    """`hidden`, the state that a scan of a stack carries from layer to
    layer, with its batch dimension (each tensor's leading one) on the data
    axes:

    - of FSDPv2's mesh when FSDPv2 wraps the stack (its `unit_output`: the
      mesh and the partition spec of a unit's output by the output, FSDPv2's
      own rule): what a unit per layer does to its output;
    - else, for a tensor with no sharding of its own, of the global mesh
      (`xs.set_global_mesh`), its axes named in `DATA_AXES`, where the
      inputs are sharded (transformers' and torch_xla's data loaders shard a
      batch on 'fsdp').

    Else `hidden` as it is. The scan keeps its carry's sharding at every step."""
    placement = unit_output
    own_kept = placement is None  # a unit shards its output whatever it had
    if own_kept:
        placement = _global_data_placement()
    if placement is None:
        return hidden
    mesh, spec_of = placement

    def placed(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.dim() or (own_kept and torch_xla._XLAC._get_xla_sharding_spec(tensor)):
            return tensor
        return constrained([tensor], [mesh.get_op_sharding(spec_of(tensor))])[0]

    return tree_map_only(torch.Tensor, placed, hidden)


def _global_data_placement():
    """The global mesh and the partition spec of a batch on its `DATA_AXES`
    (by the tensor), or None without SPMD, a global mesh or such axes."""
    import torch_xla.distributed.spmd as xs

    mesh = xs.get_global_mesh() if torch_xla.runtime.is_spmd() else None
    axes = tuple(axis for axis in (mesh.axis_names or ()) if axis in DATA_AXES) if mesh else ()
    if not axes:
        return None
    batch = axes[0] if len(axes) == 1 else axes
    return mesh, lambda tensor: (batch, *(None,) * (tensor.dim() - 1))


def teach_fsdp_v2(stack_class: type) -> None:
    """Teaches FSDPv2 (above) about the stacks of `stack_class` (LayerStack,
    given by its module, which imports this one), once per process, through
    `torch_xla_ext.patches.torch_xla`."""
    prepare_fsdp_v2(functools.partial(_before_wrapping, stack_class))
    keep_whole_in_auto_wrap(stack_class)


# The classes of modules that hold stacks out of the module tree (`stacks()`).
_HOLDERS: set[type] = set()


def keep_whole(holder_class: type) -> None:
    """torch_xla's auto-wrapping keeps modules of `holder_class`
    (`StackedList`, whose `stacks()` are its segments' stacks) whole, as it
    keeps stacks (above); FSDPv2 finds their stacks; and `mark_sharding` of
    a stacked layer's parameter shards its stacked tensor (`storage`)."""
    _HOLDERS.add(holder_class)
    keep_whole_in_auto_wrap(holder_class)
    route_mark_sharding(_layer_tensor_sharded)


def _layer_tensor_sharded(tensor, mesh, partition_spec):
    """`mark_sharding` of a stacked layer's parameter: its stacked tensor
    sharded (`LayerStorage.shard`), the layer's view returned; None for any
    other tensor."""
    place = storage_of(tensor) if isinstance(tensor, torch.Tensor) else None
    if place is None:
        return None
    import torch_xla.distributed.spmd.xla_sharding as xla_sharding

    storage, name, index = place
    storage.shard(name, index, mesh, partition_spec, xla_sharding.mark_sharding)
    return tensor


def _stacks_in(module: nn.Module, stack_class: type) -> list:
    found = []
    for each in module.modules():
        if isinstance(each, stack_class):
            found.append(each)
        elif isinstance(each, tuple(_HOLDERS)):
            found.extend(each.stacks())
    return found


def _before_wrapping(stack_class: type, module, *args, mesh=None, **kwargs) -> None:
    """What FSDPv2 does first when it wraps `module`: each stack's stacked
    parameters sharded as one layer's, and the stack told its unit's output
    sharding."""
    import torch_xla.distributed.spmd as spmd
    from torch_xla.experimental import spmd_fully_sharded_data_parallel as fsdp_v2

    stacks = _stacks_in(module, stack_class) if isinstance(module, nn.Module) else []
    sharding_mesh = spmd.get_global_mesh() if mesh is None else mesh
    # Not a module, a module wrapped already, or no usable mesh: FSDPv2's
    # own checks raise, before anything is sharded.
    if (stacks and not isinstance(module, fsdp_v2.SpmdFullyShardedDataParallel)
            and sharding_mesh is not None and "fsdp" in sharding_mesh.axis_names):
        module.to("xla")  # as FSDPv2 does before sharding: only XLA tensors are sharded
        unit_output = functools.partial(fsdp_v2._prepare_spmd_partition_spec,
                                        extra_data_axis=kwargs.get("extra_data_axis"))
        for stack in stacks:
            _shard_stacked_parameters(stack, sharding_mesh, fsdp_v2)
            stack.unit_output = (sharding_mesh, unit_output)
    if (stacks and kwargs.get("auto_wrap_policy") is not None
            and kwargs.get("auto_wrapper_callable") is not None):
        # stacklevel: here, FSDPv2's __init__, the code that wraps.
        warnings.warn(
            f"FSDP's auto_wrapper_callable (with which transformers' xla_fsdp_grad_ckpt "
            f"checkpoints each unit) is applied "
            f"to the units auto_wrap_policy picks, and the {len(stacks)} layer stack(s) of "
            f"{type(module).__name__}, which run their layers as one scan, are no units of "
            f"their own: it reaches their layers only inside a unit that holds a stack. "
            f"For the scan to recompute each layer in the backward, call "
            f"model.gradient_checkpointing_enable() (transformers) or give the stack "
            f"partition_fn='save_nothing'.", ShardingWarning, stacklevel=3)


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
