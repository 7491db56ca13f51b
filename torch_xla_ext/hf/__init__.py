"""Hugging Face transformers models whose layers run as scans, under the
model's own, unmodified `forward`.

`stack_layers(model)` replaces each layer list of a transformers model (an
`nn.ModuleList` of blocks: decoder layers, encoder layers, a vision tower's
layers) by a `StackedLayers`, which holds the layers' weights stacked, in
segments of layers alike in structure. The model's forward loops over it as
it looped over the list; what each call's layers do is planned from what the
forward calls them with (`layer_stack`: a dry run per kind of call): runs of
alike layers each one scan, patterns that repeat one scan over their groups,
the rest one by one, with a `LayerByLayerWarning` saying why. Everything else
about the model stays as it was: its forward, its config, the rest of its
modules, and the per-layer names of its `state_dict()`.

The modules, one job each: `discovery` (finding the layer lists, and what
keeps one from being stacked), `stacks` (`StackedLayers`: how a run's scan
takes transformers' arguments), `cache_plan` (how a call with a key/value
cache runs: the one description of it, and the decision), `caches`
(transformers' key/value caches around the scan), `adapters` (peft's
whole-model operations on a stacked model), `checkpointing` (transformers'
gradient checkpointing as the scan's policy), `experts` (mixture-of-experts
implementations).
"""
from __future__ import annotations

import warnings

from torch import nn

from torch_xla_ext.hf import adapters
from torch_xla_ext.hf.discovery import (
    LayerList, Unstackable, UnstackedLayersWarning, layer_list, layer_list_paths,
    recorded_outputs, submodule)
from torch_xla_ext.hf.stacks import StackedLayers, any_standing, retire
from torch_xla_ext.layer_stack import (
    OwnerPlans, checked_stack_options, drive_loops, loop_names, undrive_loops)
from torch_xla_ext.patches import peft as peft_changes

__all__ = ["StackedLayers", "UnstackedLayersWarning", "stack_layers", "unstack_layers"]


def stack_layers(model: nn.Module, path: str | None = None, **options) -> nn.Module:
    """Stacks the layer lists of a transformers model in place; returns `model`.

    Each list becomes a `StackedLayers` holding the same layers, whose
    weights are stored once, stacked per segment of layers alike in
    structure (`[layers, out, in]`), each layer's Parameters views of their
    slices (`torch_xla_ext.layer_stack.storage`). The model's own forward
    then runs its loop over the layers as a few scans: at its first call of
    each kind (the arguments' shapes and constants, the model's mode and
    settings), the forward runs once with the layers recorded, and the plan
    of that kind of call follows from what each layer was called with:

    * consecutive layers called each on what the one before returned, with
      the same arguments or a tensor per layer (a per-layer input, a mask per
      kind of attention), are one scan; a pattern of kinds that repeats
      (Jamba's, Gemma's) one scan over its groups; a layer alike to none of
      its neighbours runs as itself;
    * layers the forward works between (it changes what a layer returned
      before the next gets it), layers that compute differently from all
      their neighbours, and a forward that reads a tensor's value while it
      loops (LayerDrop) run one by one, with a `LayerByLayerWarning` saying
      why; so does a call whose key/value cache a scan cannot hold (see
      `torch_xla_ext.hf.cache_plan`), on a device other than XLA, or with
      experts implementations other than `batched_mm`.

    Every call gives the unconverted model's results; each checks that the
    forward calls the layers as its plan says, and raises where it does not.

    What stays as it was: the model's forward and config, every module (the
    layers too, the same objects, found by class in `modules()`) and
    Parameter (the same leaf tensors, under the same names), so optimizers
    made before or after converting, per-layer param groups, freezing
    layers and `state_dict()` are the unconverted model's:
    `save_pretrained()` writes an ordinary checkpoint and `load_state_dict()`
    of one works.
    Per-layer outputs the model collects (`output_hidden_states`,
    `output_attentions`), with transformers' hooks or in its own loop, come
    from the scans. peft: `stack_layers(get_peft_model(model, config))` and
    `get_peft_model(stack_layers(model), config)` give the same model (see
    `torch_xla_ext.hf.adapters`). Gradient checkpointing (before or after the
    conversion) makes the scans recompute each layer while training. FSDPv2
    shards each stacked weight as it would one layer's, and the scans keep the
    hidden state batch-sharded as a unit per layer would. A module hook on a
    layer or one of its modules, made before converting or after, runs as
    unconverted: that layer runs as itself, outside the scans.

    Refused, with an error that leaves the model unchanged (or, for one list
    among others found without `path`, an `UnstackedLayersWarning` leaving
    that list as it was): gradient checkpointing on some layers only (`every_n_layers`), a parameter shared between
    layers, a setting that reaches the layer's own modules through another
    object. Each is known before any stack is made (`discovery.layer_list`);
    an error raised while making one is not a refusal and propagates as it is.

    Args:
      model: a transformers model, on any device.
      path: the attribute path of the layer list to stack, such as
        "model.layers"; an error says why if it cannot be stacked. By default
        every `nn.ModuleList` of blocks (modules made of modules) not inside
        another one's layers.
      options: passed to each segment's `LayerStack`: `partition_fn` (what
        the forward loop keeps for the backward: a policy of
        `torch_xla_ext.policies` or its name), `is_layer_pure`, `unroll`
        (layers per iteration of the scan's loop), `per_layer_attributes`
        (default `("layer_idx",)`: settings that only pick a per-layer
        resource, which a trace must not read). A wrong one raises a
        TypeError or ValueError naming it ("stack_layers: unroll must be
        ..."), before anything is looked at.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"stack_layers: model must be an nn.Module, got {type(model).__name__}")
    checked_stack_options("stack_layers", **options)  # a wrong option raises, naming it
    adapters.teach_peft(stack_layers, _unstack)
    found = [layer_list(model, each, options) for each in
             (layer_list_paths(model) if path is None else [path])]
    # What cannot be stacked is known before any stack is made; an error
    # raised while making one is a bug, and propagates as it is.
    stacks = [(each, _stack(each, options)) for each in found if isinstance(each, LayerList)]
    refused = [each for each in found if isinstance(each, Unstackable)]
    for unstackable in refused:
        message = (f"stack_layers: cannot stack the layers at {unstackable.path!r}: "
                   f"{unstackable.reason}")
        if path is not None or not stacks:
            raise unstackable.error(f"{message}; the model is unchanged.")
        warnings.warn(f"{message}; they stay as they were, and the model's other layer lists "
                      f"are stacked.", UnstackedLayersWarning, stacklevel=2)
    for each, stack in stacks:
        if stack.unlike_neighbours is not None:
            warnings.warn(f"stack_layers: the layers at {each.path!r} are each built otherwise "
                          f"than their neighbours ({stack.unlike_neighbours}), so no run of "
                          f"alike layers makes a scan: each runs as itself, as unconverted.",
                          UnstackedLayersWarning, stacklevel=2)
    # Every stack is made before any is put in place: a refusal leaves the model unchanged.
    owners = {}
    for each, stack in stacks:
        setattr(each.owner, each.name, stack)
        owners.setdefault(id(each.owner), (each.owner, []))[1].append(each.name)
    for owner, names in owners.values():
        plans = OwnerPlans()
        drive_loops(owner, (*loop_names(owner), *names), plans.start, plans.traced)
    return model


def _stack(found: LayerList, options: dict) -> StackedLayers:
    """The stack that stands for the layer list `found`."""
    recorded = recorded_outputs(found.recorder)
    if recorded:
        # transformers puts these hooks on the layers at the first call that asks for
        # per-layer outputs; a stack replays its template's (a copy of a layer) after
        # each scan, so they must be on the layers before it copies them.
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
        maybe_install_capturing_hooks(found.recorder)
    return StackedLayers(found.layers, found.config, recorded, **options)


def unstack_layers(model: nn.Module, path: str | None = None) -> nn.Module:
    """Undoes `stack_layers` in place; returns `model`.

    Each `StackedLayers` of the model (only the one at `path`, if given)
    becomes an `nn.ModuleList` of its layers, each holding parameters and
    buffers of its own, copied from its slices of the stacked ones (which
    are dropped). For code that must find each layer among the model's
    modules; `stack_layers(model)` stacks them again. Once no stacked model
    remains (no `StackedLayers` made, copied or unpickled stands in a model),
    the changes `stack_layers` made to peft and transformers are undone too
    (docs/design.md, "Changes to other libraries")."""
    for each in stacked_paths(model) if path is None else [path]:
        _unstack(model, each)
    if not any_standing():
        peft_changes.undo()
    return model


def _unstack(model: nn.Module, path: str) -> None:
    """Replaces the stack at `path` by its layers. (peft's operations do it
    for their span, through `adapters`, without undoing the changes to peft.)"""
    stack = submodule(model, path)
    if not isinstance(stack, StackedLayers):
        raise TypeError(f"unstack_layers: {path!r} is a {type(stack).__name__}, not the "
                        f"StackedLayers that stack_layers made; pass the path of that.")
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    setattr(parent, name, nn.ModuleList(stack.unstacked()).train(stack.training))
    retire(stack)
    names = tuple(other for other in loop_names(parent) if other != name)
    undrive_loops(parent)
    if names:
        plans = OwnerPlans()
        drive_loops(parent, names, plans.start, plans.traced)


def stacked_paths(model: nn.Module) -> list[str]:
    """The paths of the model's stacks."""
    return [name for name, module in model.named_modules() if isinstance(module, StackedLayers)]
