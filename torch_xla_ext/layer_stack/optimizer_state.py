"""Optimizer state dicts of stacked layers, in the unconverted layout.

A `torch.optim.Optimizer` state dict names parameters by their position in
its param groups: `param_groups[g]["params"]` are integers and `state[i]`
holds tensors shaped like parameter i (AdamW's `exp_avg`, SGD's
`momentum_buffer`) and scalars (`step`). A model whose layers are stacked
(`LayerStack`, `stack_layers`) has one `[L, ...]` parameter where the
unconverted model has L, so a state dict of one does not load into the
other's optimizer (groups of other sizes), though `model.state_dict()` of
both has the same keys.

The design: the saved form is always the unconverted one, as the model's
`state_dict()` keys are. An optimizer whose groups hold stacked parameters

* saves (`state_dict()`) each stacked parameter as its L per-layer
  parameters, in the order the unconverted model's groups list them, with
  its state sliced per layer (views; a scalar such as `step` copied to every
  layer), so the file loads into the unconverted model's optimizer, in any
  process, with no help from here;
* loads (`load_state_dict()`) a state dict in that layout by stacking the
  per-layer states (the per-layer scalars must agree: the stacked parameter
  has one), and a state dict in its own stacked layout as it is (one saved
  before this module existed). Which layout a state dict is in is told by
  its groups' sizes, and where both layouts have the same sizes (a single
  layer) by the shapes of its state tensors.

Groups in the unconverted layout. A group's parameters keep their order,
except that each run of consecutive stacked parameters of one stack becomes
the layers' parameters layer by layer, each layer's in the order of its own
`parameters()`: what the unconverted model gives for a group selected from
its `parameters()` in model order (`AdamW(model.parameters())`, and the
Trainer's groups with and without weight decay, frozen parameters left out).
A group in another order is saved in an order of this rule, so it still
loads back into the converted model's optimizer. Named groups
(`param_names`, an optimizer made from `named_parameters()`) save the
unconverted names (`model.layers.3.mlp.up_proj.weight`).

How an optimizer finds its stacks, with no change to a user's code: the
first stack made in a process wraps `torch.optim.Optimizer.__init__`
(`torch_xla_ext.patches.torch`), so that each optimizer made afterwards registers a state_dict post-hook and a
load_state_dict pre-hook (torch's per-instance hooks); each stack records
itself in a weak set of live stacks (also when copied or unpickled). The
hooks match the optimizer's parameters against the live stacks' current
parameters (`.to(device)` replaces them), so they leave any other
optimizer's state dict as it is. An LR scheduler's state dict names no
parameters and loads either way as it is.
"""
from __future__ import annotations

import dataclasses
import itertools
import weakref

import torch

from torch_xla_ext.patches.torch import hook_optimizers

# The stacks alive in this process whose parameters an optimizer may hold;
# the segments of a `StackedList` are its own, not listed here.
_stacks: "weakref.WeakSet" = weakref.WeakSet()


def track(stack, inner=()) -> None:
    """Records `stack` (anything with `layer_parameters()` and
    `named_parameters()`) as a live stack, `inner` stacks inside it as no
    stacks of their own, and teaches optimizers to find it."""
    _stacks.add(stack)
    for each in inner:
        _stacks.discard(each)
    hook_optimizers(_register_hooks)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One parameter of an optimizer group in the unconverted layout: `param`
    itself (`layer` None), or slice `layer` of the stacked `param`."""
    param: torch.Tensor
    layer: int | None = None
    stacked_name: str = ""    # the stacked parameter's name in its stack
    per_layer_name: str = ""  # the per-layer parameter's name in the layer list


def _owners() -> dict[int, object]:
    """id of each live stack's parameters -> its stack."""
    return {id(param): stack for stack in list(_stacks) for param in stack.parameters()}


def _unconverted_entries(params: list, owners: dict) -> list[_Entry]:
    """A group's parameters in the unconverted layout (see the module docstring)."""
    entries = []
    for stack, run in itertools.groupby(params, key=lambda param: owners.get(id(param))):
        run = list(run)
        if stack is None:
            entries.extend(_Entry(param) for param in run)
            continue
        members = {id(param) for param in run}
        stacked = dict(stack.named_parameters())
        entries.extend(_Entry(stacked[name], layer, name, per_layer_name)
                       for name, layer, per_layer_name in stack.layer_parameters()
                       if id(stacked[name]) in members)
    return entries


def _layouts(optimizer) -> list[list[_Entry]] | None:
    """Each group of `optimizer` in the unconverted layout, or None if no
    group holds a stacked parameter."""
    owners = _owners()
    if not any(id(param) in owners for group in optimizer.param_groups
               for param in group["params"]):
        return None
    return [_unconverted_entries(group["params"], owners) for group in optimizer.param_groups]


def _unconverted_name(name: str, entry: _Entry) -> str:
    """The per-layer parameter's name, from the stored one's name in the group
    (a stacked parameter's, or that of a layer a stack holds as itself)."""
    if name.endswith(entry.stacked_name):
        return name[:len(name) - len(entry.stacked_name)] + entry.per_layer_name
    # A name of the user's own: a stacked one's with the layer appended.
    return name if entry.layer is None else f"{name}.{entry.layer}"


def _layer_state(state: dict, param: torch.Tensor, layer: int, optimizer) -> dict:
    """Layer `layer`'s share of a stacked parameter's state."""
    sliced = {}
    for key, value in state.items():
        if _is_per_element(key, value, param.shape):
            sliced[key] = value[layer]
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            sliced[key] = value.clone()  # each layer's step counts on its own
        elif isinstance(value, torch.Tensor):
            raise ValueError(
                f"{type(optimizer).__name__}.state_dict(): the state {key!r} of a stacked "
                f"parameter of shape {tuple(param.shape)} has shape {tuple(value.shape)}, "
                f"neither the parameter's nor a scalar, so it cannot be split into its "
                f"layers' states; save this optimizer with the model's layers unstacked "
                f"(torch_xla_ext.hf.unstack_layers) or use an optimizer whose state is "
                f"shaped like its parameters.")
        else:
            sliced[key] = value
    return sliced


def save_unconverted(optimizer, state_dict: dict) -> dict | None:
    """state_dict post-hook: the state dict in the unconverted layout."""
    layouts = _layouts(optimizer)
    if layouts is None:
        return None
    index_of = {id(param): index for index, param in enumerate(
        itertools.chain.from_iterable(group["params"] for group in optimizer.param_groups))}
    saved_state = _other_entries(state_dict["state"])
    groups, position = [], 0
    for packed, group, entries in zip(state_dict["param_groups"], optimizer.param_groups,
                                      layouts):
        names = dict(zip(map(id, group["params"]), packed.get("param_names", ())))
        positions = range(position, position + len(entries))
        for at, entry in zip(positions, entries):
            state = state_dict["state"].get(index_of[id(entry.param)])
            if state is not None:
                saved_state[at] = (state if entry.layer is None else
                                   _layer_state(state, entry.param, entry.layer, optimizer))
        unconverted = {**packed, "params": list(positions)}
        if "param_names" in packed:
            unconverted["param_names"] = [
                names[id(entry.param)] if not entry.per_layer_name
                else _unconverted_name(names[id(entry.param)], entry) for entry in entries]
        groups.append(unconverted)
        position += len(entries)
    return {**state_dict, "state": saved_state, "param_groups": groups}


def load_unconverted(optimizer, state_dict: dict) -> dict | None:
    """load_state_dict pre-hook: a state dict in the unconverted layout, in
    the optimizer's own (stacked) layout."""
    layouts = _layouts(optimizer)
    if layouts is None or not _is_unconverted(state_dict, optimizer, layouts):
        return None
    saved_groups = state_dict["param_groups"]
    saved_state = state_dict["state"]
    # Each stacked parameter's saved index per layer, and each other parameter's.
    saved_at: dict[int, dict] = {}
    for entries, saved_group in zip(layouts, saved_groups):
        for entry, index in zip(entries, saved_group["params"]):
            saved_at.setdefault(id(entry.param), {})[entry.layer] = index
    state = _other_entries(saved_state)
    groups, position = [], 0
    for group, saved_group in zip(optimizer.param_groups, saved_groups):
        for at, param in enumerate(group["params"], position):
            indices = saved_at[id(param)]
            found = (saved_state.get(indices[None]) if None in indices
                     else _stacked_state(optimizer, param, [saved_state.get(indices[layer])
                                                            for layer in range(len(indices))]))
            if found is not None:
                state[at] = found
        converted = {key: value for key, value in saved_group.items() if key != "param_names"}
        converted["params"] = list(range(position, position + len(group["params"])))
        if "param_names" in group:
            converted["param_names"] = list(group["param_names"])
        groups.append(converted)
        position += len(group["params"])
    return {**state_dict, "state": state, "param_groups": groups}


def _other_entries(state: dict) -> dict:
    """The entries of a state dict's `state` that name no parameter (torch
    keeps a key that is not a parameter as it is)."""
    return {key: value for key, value in state.items() if not isinstance(key, int)}


def _is_unconverted(state_dict: dict, optimizer, layouts: list) -> bool:
    """Whether `state_dict` is in the unconverted layout rather than the
    optimizer's own: by its groups' sizes, else (both the same) by the
    shapes of the stacked parameters' saved states."""
    sizes = [len(group["params"]) for group in state_dict.get("param_groups", ())]
    unconverted = sizes == [len(entries) for entries in layouts]
    if unconverted != (sizes == [len(group["params"]) for group in optimizer.param_groups]):
        return unconverted
    if not unconverted:
        return False  # neither: torch's own check says what does not match
    for entries, saved_group in zip(layouts, state_dict["param_groups"]):
        for entry, index in zip(entries, saved_group["params"]):
            state = state_dict["state"].get(index, {})
            if entry.layer is not None:
                for key, value in state.items():
                    if key != "step" and isinstance(value, torch.Tensor):
                        return value.shape != entry.param.shape
    return True


def _stacked_state(optimizer, param: torch.Tensor, layer_states: list) -> dict | None:
    """The state of stacked `param` from its layers' states: tensors shaped
    like a layer's slice stacked, the rest equal in every layer."""
    if all(state is None for state in layer_states):
        return None
    if any(state is None for state in layer_states):
        missing = [layer for layer, state in enumerate(layer_states) if state is None]
        raise ValueError(
            f"{type(optimizer).__name__}.load_state_dict(): the state dict has a state for "
            f"some layers' parameters and none for layers {missing} of the parameter that is "
            f"stacked as shape {tuple(param.shape)}; a stacked parameter has one state for "
            f"all its layers. Load it into the unconverted model's optimizer instead.")
    stacked = {}
    for key, first in layer_states[0].items():
        values = [state[key] for state in layer_states]
        if _is_per_element(key, first, param.shape[1:]):
            stacked[key] = torch.stack([value.to(first.device) for value in values])
        elif all(_same(value, first) for value in values[1:]):
            stacked[key] = first
        else:
            raise ValueError(
                f"{type(optimizer).__name__}.load_state_dict(): the layers' parameters that "
                f"are stacked as shape {tuple(param.shape)} have different {key!r} in the "
                f"state dict ({[_shown(value) for value in values]}), and the stacked "
                f"parameter has one. Load it into the unconverted model's optimizer instead.")
    return stacked


def _is_per_element(key, value, shape) -> bool:
    """Whether a state value holds one number per element of a parameter of
    `shape` (as torch does, `step` never: it counts the steps)."""
    return key != "step" and isinstance(value, torch.Tensor) and value.shape == shape


def _same(value, first) -> bool:
    if isinstance(first, torch.Tensor):
        return (isinstance(value, torch.Tensor) and value.shape == first.shape
                and torch.equal(value.cpu(), first.cpu()))
    return value == first


def _shown(value):
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _register_hooks(optimizer) -> None:
    """What each optimizer does when it is made: the two hooks above."""
    optimizer.register_state_dict_post_hook(save_unconverted)
    optimizer.register_load_state_dict_pre_hook(load_unconverted)
