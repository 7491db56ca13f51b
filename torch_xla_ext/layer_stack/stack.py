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

from torch_xla_ext.diagnostics import TorchXlaExtDeprecationWarning
from torch_xla_ext.layer_stack import names, optimizer_state, scan_runner, sharding
from torch_xla_ext.layer_stack.addressed import CurrentLayouts, refusing_hooks
from torch_xla_ext.layer_stack.alike import (
    LayerLayout, Refusal, layer_tensors, shared_parameters, stackable_layers)
from torch_xla_ext.layer_stack.fakes import template_copy
from torch_xla_ext.layer_stack.segments import Segment
from torch_xla_ext.layer_stack.storage import LayerStorage, computed_now
from torch_xla_ext.patches.torch_xla import lower_host_ops
from torch_xla_ext.layer_stack.per_layer import DEFAULT_PER_LAYER_ATTRIBUTES
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
    changing its settings does not change the stack, and registering a hook
    on it raises a ValueError (the hook would never run: `addressed`; a
    `StackedList` runs such a layer as itself). `len(stack)` is the number of
    layers; iterating yields each layer.

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
        ignored_attributes = frozenset(ignored_attributes)
        options = checked_stack_options(
            "LayerStack", partition_fn=partition_fn, is_layer_pure=is_layer_pure, unroll=unroll,
            per_layer_attributes=per_layer_attributes, ignored_attributes=ignored_attributes)
        self.partition_fn = options["partition_fn"]
        self.is_layer_pure = options["is_layer_pure"]
        self.unroll = options["unroll"]
        self.per_layer_attributes = options["per_layer_attributes"]
        if ignored_attributes:
            warnings.warn(
                f"LayerStack(ignored_attributes=...) is deprecated: pass "
                f"per_layer_attributes={tuple(sorted(ignored_attributes))!r} instead (the "
                f"default, {DEFAULT_PER_LAYER_ATTRIBUTES!r}, too if you rely on it).",
                TorchXlaExtDeprecationWarning, stacklevel=2)
        self.num_layers = len(layers)
        # 'path.attribute' -> each layer's value, for the per-layer attributes that differ
        # (and, for a stack that keeps differing settings, the settings that differ).
        self.per_layer_values: dict[str, tuple] = {}
        # Those whose reads a trace watches: the per-layer attributes.
        self.watched_paths: frozenset[str] = frozenset()
        self.stacked = _StackedTensors()
        # The layer whose code runs each step; kept out of _modules so that it is
        # no part of parameters(), state_dict() or .to().
        self.__dict__["_template"] = None
        self.__dict__["_layouts"] = CurrentLayouts()  # of the templates its runners run
        if self.owns_names:
            self.register_state_dict_post_hook(_saved_per_layer)
            self.register_load_state_dict_pre_hook(_loaded_per_layer)
            optimizer_state.track(self)
        sharding.teach_fsdp_v2(LayerStack)
        lower_host_ops()  # layers' ops that torch_xla runs on the host cannot be traced
        if not layers:
            return
        # Parameters that every layer holds as one tensor (a block they share),
        # which a stack that stores in its layers keeps as it is.
        self.shared_names = shared_parameters(layers) if self.stores_in_layers else frozenset()
        checked = stackable_layers(layers, self.per_layer_attributes,
                                   any_setting=self.keeps_differing_settings,
                                   shared=self.shared_names)
        if isinstance(checked, Refusal):
            raise checked.exception()
        layout, self.per_layer_values, self.watched_paths = checked
        self.__dict__["_template"] = _meta_copy(layers[0], layout.shared)
        self.training = layers[0].training
        if self.stores_in_layers:
            self.__dict__["members"] = layers
            self.__dict__["storage"] = LayerStorage(
                layers, [name for name in layout.tensors if name not in self.shared_names])
            return
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
        computed_now(list(self._stacked_tensors().values()))

    def read_settings(self) -> None:
        """Reads the settings of the layers the stack stores in (`stores_in_layers`)
        again: layer 0's for the template, each layer's where they differ."""
        checked = stackable_layers(self.members, self.per_layer_attributes,
                                   any_setting=self.keeps_differing_settings,
                                   shared=self.shared_names)
        if isinstance(checked, Refusal):
            raise checked.exception()
        layout, self.per_layer_values, self.watched_paths = checked
        for name, value in layout.values.items():  # read from each module's __dict__
            owner_path, _, attribute = name.rpartition(".")
            self.template.get_submodule(owner_path).__dict__[attribute] = value

    # Whether the stack's state_dict() names the layers' tensors itself (not
    # when another stack holding it does: `stacked_list.StackedList`).
    owns_names = True
    # Whether the layers need only be alike in structure, each keeping its own
    # value of every setting that differs (a StackedList's segments: their
    # runs and kinds are planned per call).
    keeps_differing_settings = False
    # Whether the layers keep their own tensors, views of the stacked ones
    # (`storage.LayerStorage`), rather than the stack holding them.
    stores_in_layers = False
    # Set by FSDPv2 when it wraps the stack (see `sharding`): a unit's output sharding.
    unit_output = None

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        if self.owns_names:
            optimizer_state.track(self)  # a copy, or unpickled
        sharding.teach_fsdp_v2(LayerStack)

    @property
    def template(self) -> nn.Module | None:
        """The layer whose code runs for every layer, on each layer's tensors
        (None for an empty stack); its tensors are meta tensors."""
        return self._template

    @property
    def names(self) -> names.NameMap:
        """Its stored names and the layers' own (`names.NameMap`)."""
        if self._template is None:
            return names.NameMap(())
        return names.NameMap([names.part_of("stacked.", Segment(0, 1, len(self)),
                                            self._template, stacked=True)])

    def layer_parameters(self) -> list[tuple[str, int, str]]:
        """The layers' parameters in the order of the layer list's
        `parameters()`, each as (the name of its stacked parameter in the
        stack, its layer, its name in the layer list): for optimizer state
        dicts in the unconverted layout (`optimizer_state`)."""
        return self.names.parameters()

    def _storage(self, path: str) -> _StackedTensors:
        """The `_StackedTensors` for submodule `path`, created on first use."""
        node = self.stacked
        for part in path.split(".") if path else ():
            if part not in node._modules:
                node.add_module(part, _StackedTensors())
            node = node._modules[part]
        return node

    def _stacked_tensors(self) -> dict[str, torch.Tensor]:
        if self.stores_in_layers:
            return self.storage.operands()
        tensors = dict(self.stacked.named_parameters())
        tensors.update(self.stacked.named_buffers())
        return tensors

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        return refusing_hooks(self.layer(index), operator.index(index) % len(self))

    def unstacked(self) -> list[nn.Module]:
        """The layers as modules of their own: each with parameters and
        buffers copied from its slices (parameters keep `requires_grad`), as
        the layers were before stacking."""
        layers = [self.layer(index, copied=True) for index in range(len(self))]
        computed_now([tensor for layer in layers for tensor in (*layer.parameters(),
                                                                 *layer.buffers())])
        return layers

    def layer(self, index: int, copied: bool = False) -> nn.Module:
        """Layer `index`, holding views of its slices, or copies of them."""
        return self.built_layer(index, copied)

    def built_layer(self, index: int, copied: bool = False) -> nn.Module:
        """Layer `index` built from the template, holding views of its slices
        of the stacked tensors, or copies of them."""
        index = operator.index(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"Layer index {index} is out of range for a LayerStack of "
                             f"{len(self)} layers.")
        layer = template_copy(self._template)
        tensors = self._stacked_tensors()
        # A view's gradient reaches the stacked tensor even when the layer is
        # taken under no_grad and run with grad (in a backward: Reformer's).
        # Entered once for all slices: torch.export records each entry as
        # graph nodes, which its set_grad pass inlines one by one (a dry run
        # of 6 layers under export made 700, a third of the export's time).
        with torch.set_grad_enabled(not torch.is_inference_mode_enabled()):
            pieces = {name: tensor[index].detach().clone() if copied else tensor[index]
                      for name, tensor in tensors.items()}
        for name, tensor in tensors.items():
            owner_path, _, local_name = name.rpartition(".")
            owner = layer.get_submodule(owner_path)
            is_parameter = local_name in owner._parameters
            piece = pieces[name]
            if copied and is_parameter:
                piece = nn.Parameter(piece, requires_grad=tensor.requires_grad)
            (owner._parameters if is_parameter else owner._buffers)[local_name] = piece
        for name, param in self.shared_tensors().items():
            _put_parameter(layer, name, param)
        for path, values in self.per_layer_values.items():
            owner_path, _, name = path.rpartition(".")
            setattr(layer.get_submodule(owner_path), name, values[index])
        return layer

    def shared_tensors(self) -> dict[str, torch.Tensor]:
        """The parameters every layer holds as one tensor, by name."""
        return {name: self.members[0].get_parameter(name) for name in self.shared_names}

    def tie_shared(self) -> None:
        """Gives every layer the first layer's Parameter under each shared
        name again: moving a model to an XLA device makes a Parameter per
        module that holds it (torch_xla 2.9), which would untie them."""
        for name, param in self.shared_tensors().items():
            for member in self.members[1:]:
                _put_parameter(member, name, param)

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
        return scan_runner.run(self.runner(), hidden, args, kwargs)

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
        return scan_runner.lower(self.runner(), hidden, args, kwargs, device_kind)

    def stack_options(self) -> dict:
        """The options this stack was made with, to make another alike."""
        return dict(partition_fn=self.partition_fn, is_layer_pure=self.is_layer_pure,
                    unroll=self.unroll, per_layer_attributes=tuple(sorted(self.per_layer_attributes)))

    def layout_now(self, template: nn.Module | None = None) -> LayerLayout:
        """The layout of `template` (default: the stack's own) as its
        attributes are now, read again only when one changed."""
        return self._layouts.of(self._template if template is None else template)

    def runner(self, first: int = 0, count: int | None = None, template: nn.Module | None = None,
               positions: int = 0) -> scan_runner.Layers:
        """Layers `first`, ..., `first + count - 1` (default: all) as the
        runners take them, run by `template` (default: the stack's own; a
        copy with other settings, for layers of another kind); with
        `positions`, `template` is a group of that many layers, each step
        running `positions` consecutive layers (see `scan_runner.Layers`)."""
        count = len(self) - first if count is None else count
        tensors = self._stacked_tensors()
        if (first, count) != (0, len(self)):
            tensors = {name: tensor[first:first + count] for name, tensor in tensors.items()}
        template = self._template if template is None else template
        shared = self.shared_tensors()
        if positions:
            tensors = {name: tensor.view(count // positions, positions, *tensor.shape[1:])
                       for name, tensor in tensors.items()}
            shared = {f"layers.{position}.{name}": tensor for name, tensor in shared.items()
                      for position in range(positions)}
        return scan_runner.Layers(
            template, self.layout_now(template), tensors,
            per_layer_paths=tuple(sorted(
                f"layers.{position}.{path}" if positions else path
                for path in self.watched_paths for position in range(positions or 1))),
            layer_at=lambda index: self.layer(first + index), num_layers=count // (positions or 1),
            drop_in=False, partition_fn=self.partition_fn, is_layer_pure=self.is_layer_pure,
            unroll=self.unroll, positions=positions, unit_output=self.unit_output,
            shared_tensors=shared)

    def extra_repr(self) -> str:
        layer_type = type(self._template).__name__ if self._template is not None else "-"
        return f"num_layers={len(self)}, layer={layer_type}"


def _put_parameter(module: nn.Module, name: str, param: torch.Tensor) -> None:
    """Puts `param` under `name` ('path.attribute') in `module`, as it is."""
    owner_path, _, local_name = name.rpartition(".")
    module.get_submodule(owner_path)._parameters[local_name] = param


def _saved_per_layer(stack: LayerStack, state_dict, prefix: str, local_metadata) -> None:
    names.save_per_layer(stack.names, state_dict, prefix)
    names.per_layer_metadata(stack.names, state_dict, prefix)


def _loaded_per_layer(stack: LayerStack, state_dict, prefix: str, local_metadata, strict,
                      missing_keys, unexpected_keys, error_msgs) -> None:
    current = dict(stack.stacked.state_dict(prefix="stacked.", keep_vars=True))
    names.load_per_layer(stack.names, current, state_dict, prefix, strict, missing_keys,
                         error_msgs)


def checked_stack_options(who: str, *, partition_fn=save_everything, is_layer_pure=None,
                          unroll: int | bool = 1,
                          per_layer_attributes: Iterable[str] = DEFAULT_PER_LAYER_ATTRIBUTES,
                          ignored_attributes: Iterable[str] = (), **unknown) -> dict:
    """A `LayerStack`'s options as `who` ("LayerStack", "stack_layers", ...)
    was given them, checked and resolved: the policy (a name looked up),
    `unroll` as steps, the per-layer attributes as one frozenset (with the
    deprecated `ignored_attributes`). A wrong option is the caller's mistake,
    not a refusal of the layers: a TypeError or ValueError naming it, raised."""
    if unknown:
        raise TypeError(f"{who}: unknown option {next(iter(unknown))!r}; the options are "
                        f"partition_fn, is_layer_pure, unroll and per_layer_attributes")
    return dict(partition_fn=resolve_policy(partition_fn, who), is_layer_pure=is_layer_pure,
                unroll=check_unroll(unroll, who),
                per_layer_attributes=frozenset(per_layer_attributes) | frozenset(ignored_attributes))
