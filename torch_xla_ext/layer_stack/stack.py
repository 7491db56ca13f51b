"""`LayerStack`: the layers' tensors stacked once, run as one scan, with the
state_dict of the `nn.ModuleList` it replaces."""
from __future__ import annotations

import copy
import operator
import warnings
from typing import Iterable

import torch
import torch_xla
import torch_xla.runtime
from torch import nn

from torch_xla_ext.layer_stack import optimizer_state, running, sharding
from torch_xla_ext.layer_stack.alike import (
    check_identical_layers, join, layer_tensors, layout_of)
from torch_xla_ext.layer_stack.per_layer import DEFAULT_PER_LAYER_ATTRIBUTES
from torch_xla_ext.placeholders import depends_on_placeholder
from torch_xla_ext.policies import resolve as resolve_policy, save_everything
from torch_xla_ext.scan import Lowered
from torch_xla_ext.scan.loop import check_unroll


class _StackedTensors(nn.Module):
    """Holds the stacked tensors of one submodule path of the layers."""


def _meta_copy(layer: nn.Module, shared: Iterable) -> nn.Module:
    """A deep copy of `layer` whose parameters and buffers are meta tensors (no
    data), sharing the `shared` objects (its settings compared by identity)."""
    memo = {id(value): value for value in shared}
    for param in layer.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"),
                                       requires_grad=param.requires_grad)
    for buffer in layer.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(layer, memo)


def _computed_now(tensors: list[torch.Tensor]) -> None:
    """Computes the XLA tensors among `tensors` now, in a graph of their own.
    Left lazy, the stacking (or slicing) of a model already on the device
    would be part of the next step's graph, which would then differ from
    every later step's and compile twice, and the tensors it reads would stay
    alive until then. (Tensors computed from placeholders have no value.)"""
    lazy = [tensor for tensor in tensors
            if tensor.device.type == "xla" and not depends_on_placeholder(tensor)]
    if lazy:
        torch_xla._XLAC._xla_sync_multi(lazy, devices=[], wait=False)


def _state_dict_per_layer(stack: "LayerStack", state_dict, prefix: str,
                          local_metadata) -> None:
    """state_dict post-hook: replaces the stacked entries by per-layer ones."""
    storage_prefix = prefix + "stacked."
    stacked = {key[len(storage_prefix):]: state_dict.pop(key)
               for key in list(state_dict) if key.startswith(storage_prefix)}
    for index in range(len(stack)):
        for name, tensor in stacked.items():
            state_dict[f"{prefix}{index}.{name}"] = tensor[index]
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None and stack._template is not None:
        for key in [key for key in metadata
                    if key == storage_prefix[:-1] or key.startswith(storage_prefix)]:
            del metadata[key]
        for index in range(len(stack)):
            for path, module in stack._template.named_modules():
                metadata[join(f"{prefix}{index}", path)] = {"version": module._version}


class LayerStack(nn.Module):
    """Structurally identical layers, run as one scan with their weights stacked.

    Built from an `nn.ModuleList` (or any iterable) of layers, it copies every
    parameter and buffer into one tensor per name with a leading layer
    dimension, held under `stacked` (`stack.stacked.self_attn.q_proj.weight` is
    `[num_layers, out, in]`); those are its `parameters()`, for optimizers and
    gradient clipping. The original layers are not used afterwards: drop them to
    free their memory. Layers already on an XLA device are stacked there at
    once, in a small graph of their own, so that the first step's graph is
    the same as every later step's.

    `stack(hidden, *args, **kwargs)` runs the layers in order, each called as
    `layer(hidden, *args, **kwargs)` with the same extra arguments (attention
    masks, position ids, rotary embeddings as tensors, or plain constants). When
    a layer returns a tuple its first element is the hidden state for the next
    layer and the rest (attention weights, caches) is discarded: the stack
    returns the last layer's hidden state only. The hidden state must keep its
    shape and dtype from layer to layer. An empty stack returns `hidden`. A
    call that the scan cannot stand for (a key/value cache object among the
    arguments, a layer that reads its `layer_idx`) runs the layers one by one,
    as the loop does (see the module docstring).

    `stack[i]` is layer i as a module of the layers' type whose parameters and
    buffers are views of slice i of the stacked tensors (not Parameters of its
    own) and whose per-layer attributes are layer i's, rebuilt at each access;
    changing its settings does not change the stack. `len(stack)` is the number of layers; iterating yields each layer.

    `state_dict()` and `load_state_dict()` use the per-layer names and tensors an
    `nn.ModuleList` of the same layers would (`3.self_attn.q_proj.weight`), so
    checkpoints move between the two.

    Args:
      layers: the layers, identical in submodule types and names, parameter and
        buffer shapes and dtypes, and settings (dropout `p`, `eps`, `training`,
        activation functions, configs, ...; see the module docstring).
      partition_fn: what the forward loop keeps for the backward loop: a
        policy of `torch_xla_ext.policies` (`save_nothing`, `offload("x")`,
        ...), its name, or an AOTAutograd partitioner; passed to `scan`.
      is_layer_pure: passed to `scan` as `is_fn_pure`.
      unroll: layers run per iteration of the scan's While loop (and of its
        backward loop), an int of 1 or more, or True for all; passed to
        `scan`. The results are the same for every value; a layer count that
        is not a multiple of it leaves the last layers to run after the loop.
      per_layer_attributes: names of attributes that may differ between layers,
        each layer keeping its own value; calls whose traced computation reads
        one run layer by layer (see the module docstring).
      ignored_attributes: deprecated, the former name of
        `per_layer_attributes`; its names are added to them, with a
        DeprecationWarning.
    """

    def __init__(self, layers: Iterable[nn.Module], *, partition_fn=save_everything,
                 is_layer_pure=None, unroll: int | bool = 1,
                 per_layer_attributes: Iterable[str] = DEFAULT_PER_LAYER_ATTRIBUTES,
                 ignored_attributes: Iterable[str] = ()):
        super().__init__()
        layers = list(layers)
        self.partition_fn = resolve_policy(partition_fn, "LayerStack")
        self.is_layer_pure = is_layer_pure
        self.unroll = check_unroll(unroll, "LayerStack")
        ignored_attributes = frozenset(ignored_attributes)
        if ignored_attributes:
            warnings.warn(
                f"LayerStack(ignored_attributes=...) is deprecated: pass "
                f"per_layer_attributes={tuple(sorted(ignored_attributes))!r} instead (the "
                f"default, {DEFAULT_PER_LAYER_ATTRIBUTES!r}, too if you rely on it).",
                DeprecationWarning, stacklevel=2)
        self.per_layer_attributes = frozenset(per_layer_attributes) | ignored_attributes
        self.num_layers = len(layers)
        # 'path.attribute' -> each layer's value, for the per-layer attributes that differ.
        self.per_layer_values: dict[str, tuple] = {}
        self.stacked = _StackedTensors()
        # The layer whose code runs each step; kept out of _modules so that it is
        # no part of parameters(), state_dict() or .to().
        self.__dict__["_template"] = None
        self.register_state_dict_post_hook(_state_dict_per_layer)
        optimizer_state.track(self)
        sharding.teach_fsdp_v2()
        if not layers:
            return
        layout, self.per_layer_values = check_identical_layers(layers,
                                                                 self.per_layer_attributes)
        _check_no_shared_parameters(layers)
        self.__dict__["_template"] = _meta_copy(layers[0], layout.shared)
        self.training = layers[0].training
        with torch.no_grad():
            per_layer = [layer_tensors(layer, layout.tensors) for layer in layers]
            for name, spec in layout.tensors.items():
                owner_path, _, local_name = name.rpartition(".")
                owner = self._storage(owner_path)
                stacked = torch.stack([tensors[name] for tensors in per_layer])
                if spec.is_parameter:
                    owner.register_parameter(local_name,
                                             nn.Parameter(stacked, requires_grad=spec.flag))
                else:
                    owner.register_buffer(local_name, stacked, persistent=spec.flag)
        _computed_now(list(self._stacked_tensors().values()))

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        optimizer_state.track(self)  # a copy, or unpickled
        sharding.teach_fsdp_v2()

    def layer_parameters(self) -> list[tuple[str, int, str]]:
        """The layers' parameters in the order of the layer list's
        `parameters()`, each as (the name of its stacked parameter in the
        stack, its layer, its name in the layer list): for optimizer state
        dicts in the unconverted layout (`optimizer_state`)."""
        if self._template is None:
            return []
        names = [name for name, _ in self._template.named_parameters()]
        return [(f"stacked.{name}", index, f"{index}.{name}")
                for index in range(len(self)) for name in names]

    def _storage(self, path: str) -> _StackedTensors:
        """The `_StackedTensors` for submodule `path`, created on first use."""
        node = self.stacked
        for part in path.split(".") if path else ():
            if part not in node._modules:
                node.add_module(part, _StackedTensors())
            node = node._modules[part]
        return node

    def _stacked_tensors(self) -> dict[str, torch.Tensor]:
        tensors = dict(self.stacked.named_parameters())
        tensors.update(self.stacked.named_buffers())
        return tensors

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        return self._layer(index, copied=False)

    def unstacked(self) -> list[nn.Module]:
        """The layers as modules of their own: each with parameters and
        buffers copied from its slices (parameters keep `requires_grad`), as
        the layers were before stacking."""
        layers = [self._layer(index, copied=True) for index in range(len(self))]
        _computed_now([tensor for layer in layers for tensor in (*layer.parameters(),
                                                                 *layer.buffers())])
        return layers

    def _layer(self, index, copied: bool) -> nn.Module:
        """Layer `index`, holding views of its slices, or copies of them."""
        index = operator.index(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"Layer index {index} is out of range for a LayerStack of "
                             f"{len(self)} layers.")
        layer = copy.deepcopy(self._template)
        for name, tensor in self._stacked_tensors().items():
            owner_path, _, local_name = name.rpartition(".")
            owner = layer.get_submodule(owner_path)
            is_parameter = local_name in owner._parameters
            piece = tensor[index].detach().clone() if copied else tensor[index]
            if copied and is_parameter:
                piece = nn.Parameter(piece, requires_grad=tensor.requires_grad)
            (owner._parameters if is_parameter else owner._buffers)[local_name] = piece
        for path, values in self.per_layer_values.items():
            owner_path, _, name = path.rpartition(".")
            setattr(layer.get_submodule(owner_path), name, values[index])
        return layer

    def __iter__(self):
        return (self[index] for index in range(len(self)))

    def train(self, mode: bool = True) -> "LayerStack":
        super().train(mode)
        if self._template is not None:
            self._template.train(mode)
        return self

    def forward(self, hidden, *args, **kwargs):
        if self._template is None:
            return hidden
        return running.run(self._layers(), hidden, args, kwargs)

    def lower(self, hidden, *args, device_kind: str | None = None, **kwargs) -> Lowered:
        """Stages `self(hidden, *args, **kwargs)` without running it: the HLO of
        its forward and backward loops as they would run on `device_kind`
        (default: the current device's kind), as `torch_xla_ext.lower` gives.
        `hidden` and tensor arguments may be placeholders; nothing is
        transferred or executed."""
        if self._template is None:
            raise ValueError("lower: an empty LayerStack runs no scan")
        if device_kind is None:
            device_kind = torch_xla.runtime.device_type()
        return running.lower(self._layers(), hidden, args, kwargs, device_kind)

    def stack_options(self) -> dict:
        """The options this stack was made with, to make another alike."""
        return dict(partition_fn=self.partition_fn, is_layer_pure=self.is_layer_pure,
                    unroll=self.unroll, per_layer_attributes=tuple(sorted(self.per_layer_attributes)))

    def _layers(self) -> running.Layers:
        return running.Layers(
            self._template, layout_of(self._template, 0), self._stacked_tensors(),
            per_layer_paths=tuple(self.per_layer_values), layer_at=self.__getitem__,
            num_layers=len(self), drop_in=False, partition_fn=self.partition_fn,
            is_layer_pure=self.is_layer_pure, unroll=self.unroll)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        # Gathers the per-layer entries into one stacked entry per tensor, which
        # the `stacked` submodules then load; what is absent or the wrong shape is
        # reported under its per-layer name and keeps the current value.
        # The stacked state_dict lists the persistent tensors only, as checkpoints do.
        for name, current in self.stacked.state_dict(keep_vars=True).items():
            slices = []
            for index in range(len(self)):
                key = f"{prefix}{index}.{name}"
                loaded = state_dict.pop(key, None)
                if loaded is None:
                    if strict:
                        missing_keys.append(key)
                elif loaded.shape != current.shape[1:]:
                    error_msgs.append(
                        f"size mismatch for {key}: copying a param with shape {loaded.shape} from "
                        f"checkpoint, the shape in current model is {current.shape[1:]}.")
                    loaded = None
                slices.append(loaded)
            found = next((loaded for loaded in slices if loaded is not None), None)
            if found is None:
                stacked = current.detach()
            else:
                stacked = torch.stack([
                    current[index].detach().to(found) if loaded is None else loaded
                    for index, loaded in enumerate(slices)
                ])
            state_dict[f"{prefix}stacked.{name}"] = stacked
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        layer_type = type(self._template).__name__ if self._template is not None else "-"
        return f"num_layers={len(self)}, layer={layer_type}"


def _check_no_shared_parameters(layers: list) -> None:
    """LayerStack gives each layer its own slice, which would untie shared parameters."""
    owners = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            first_index, first_name = owners.setdefault(id(param), (index, name))
            if first_index != index:
                raise ValueError(
                    f"Layer {index} parameter '{name}' is the same tensor as layer "
                    f"{first_index}'s '{first_name}'; a LayerStack stores one copy per layer "
                    f"and would untie them. Give each layer its own parameters, or keep "
                    f"the shared one outside the layers.")
