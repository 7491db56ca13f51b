"""Optimizer steps over the layers' Parameters, taken as steps of the
stacked tensors where that is the same update.

An optimizer holds the layers' own Parameters (`storage`), each a view of
its slice of a stacked tensor. Stepped one by one, they update each slice
by itself: per tensor name a chain of as many dynamic-update-slices as
layers, which XLA's compile time grows with. Where an optimizer's update
is elementwise, with per-parameter state that is tensors of the
parameter's shape or values all its parameters share (`ELEMENTWISE`: the
state of SGD's momentum, Adam's moments and step), updating a stacked
tensor with its stacked gradient is the same as updating each slice with
its own. So a step of such an optimizer (`before_step`, through torch's
global step hooks) puts, for that step, in place of all of a stacked
tensor's layer Parameters found in one param group, the stacked tensor
itself, when each of them holds the gradient view its storage gave it;
everything else (a group per layer, frozen layers, a gradient replaced,
another optimizer) steps as given, one by one, as unconverted.

Between steps the state of a stacked tensor stays in `optimizer.state`
under it; `state_dict()` gives it per layer, as views of its slices
(`_per_layer_state`), and a state loaded per layer is stacked at the next
step (`_stacked_state`).
"""
from __future__ import annotations

import weakref

import torch

from torch_xla_ext.layer_stack.storage import LayerStorage, stacked_place, storage_of
from torch_xla_ext.patches.torch import around_optimizer_steps

__all__ = ["ELEMENTWISE", "step_stacked"]

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
               torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
               torch.optim.Adadelta, torch.optim.Rprop)

# Per optimizer in a step: the groups whose params lists the step replaced, with the lists.
_SWAPPED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list]" = weakref.WeakKeyDictionary()
# The optimizers whose state_dict() gives stacked state per layer.
_HOOKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def step_stacked() -> None:
    """Makes every optimizer's steps take stacked tensors where they may
    (above), once per process."""
    around_optimizer_steps(before_step, after_step)


def before_step(optimizer: torch.optim.Optimizer) -> None:
    after_step(optimizer)  # a step that raised left its lists replaced
    if type(optimizer) not in ELEMENTWISE:
        return
    swapped = []
    for group in optimizer.param_groups:
        params = group["params"]
        found: dict[tuple[int, str], list] = {}
        for position, param in enumerate(params):
            place = storage_of(param)
            if place is not None:
                storage, name, index = place
                found.setdefault((id(storage), name), [storage, name, []])[2].append(
                    (position, index))
        replaced = {}
        for storage, name, places in found.values():
            if (sorted(index for _, index in places) == list(range(storage.size))
                    and storage.hands_whole_gradient(name)
                    and _stacked_state(optimizer, storage, name)):
                positions = sorted(position for position, _ in places)
                replaced.update({position: None for position in positions})
                stacked = replaced[positions[0]] = storage.stacked[name]
                stacked.grad = storage.given_gradient(name)  # for the step only
            else:
                _per_layer_again(optimizer, storage, name)
        if replaced:
            swapped.append((group, params))
            group["params"] = [replaced.get(position, param) for position, param
                               in enumerate(params) if replaced.get(position, param) is not None]
    if swapped:
        _SWAPPED[optimizer] = swapped
        if optimizer not in _HOOKED:
            _HOOKED.add(optimizer)
            optimizer.register_state_dict_pre_hook(_before_state_dict)
            optimizer.register_state_dict_post_hook(_after_state_dict)


def after_step(optimizer: torch.optim.Optimizer) -> None:
    for group, params in _SWAPPED.pop(optimizer, ()):
        for tensor in group["params"]:
            if stacked_place(tensor) is not None:
                tensor.grad = None  # the layers hold it, as views of it
        group["params"] = params


def _is_per_layer(value, stacked: torch.Tensor) -> bool:
    """Whether a state value of a stacked tensor holds one value per layer."""
    return isinstance(value, torch.Tensor) and value.shape == stacked.shape


def _stacked_state(optimizer, storage: LayerStorage, name: str) -> bool:
    """Whether the stacked tensor `name` can step with the optimizer's state:
    its own, none yet, or its layers' (stacked now, one value per layer, or
    a value all share)."""
    stacked, params = storage.stacked[name], storage.parameters[name]
    states = [optimizer.state[param] for param in params if param in optimizer.state]
    if not states:
        return True
    if len(states) < len(params) or stacked in optimizer.state:
        return False
    merged = {}
    for key, first in states[0].items():
        values = [state.get(key) for state in states]
        if isinstance(first, torch.Tensor) and first.shape == params[0].shape:
            merged[key] = torch.stack(values)
        elif all(_same(value, first) for value in values):
            merged[key] = first
        else:
            return False
    optimizer.state[stacked] = merged
    for param in params:
        del optimizer.state[param]
    return True


def _same(value, other) -> bool:
    if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor):
        return value.shape == other.shape and bool(torch.equal(value, other))
    return value is other or (not isinstance(value, torch.Tensor) and value == other)


def _per_layer_again(optimizer, storage: LayerStorage, name: str) -> None:
    """A stacked tensor stepping one layer at a time again: its state, if
    any, becomes its layers' (copies of their slices)."""
    stacked = storage.stacked[name]
    if stacked in optimizer.state:
        for param, state in zip(storage.parameters[name],
                                _per_layer_state(optimizer.state.pop(stacked), stacked)):
            optimizer.state[param] = {key: value.clone() if _is_per_layer(value, stacked)
                                      else value for key, value in state.items()}


def _per_layer_state(state: dict, stacked: torch.Tensor) -> list[dict]:
    """A stacked tensor's state as each layer's: views of the slices, and a
    copy each of a shared tensor (Adam's step, which a step of the layers
    one by one increments in place for each)."""
    return [{key: value[index] if _is_per_layer(value, stacked)
             else value.clone() if isinstance(value, torch.Tensor) else value
             for key, value in state.items()} for index in range(stacked.shape[0])]


# The stacked states state_dict() set aside, per optimizer.
_SET_ASIDE: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list]" = weakref.WeakKeyDictionary()


def _before_state_dict(optimizer) -> None:
    aside = []
    for key in list(optimizer.state):
        place = _stacked_place(key)
        if place is None:
            continue
        storage, name = place
        state = optimizer.state.pop(key)
        for param, layer_state in zip(storage.parameters[name], _per_layer_state(state, key)):
            optimizer.state[param] = layer_state
        aside.append((key, state, storage.parameters[name]))
    _SET_ASIDE[optimizer] = aside


def _after_state_dict(optimizer, state_dict: dict) -> dict:
    for key, state, params in _SET_ASIDE.pop(optimizer, ()):
        for param in params:
            optimizer.state.pop(param, None)
        optimizer.state[key] = state
    return state_dict


def _stacked_place(key) -> tuple[LayerStorage, str] | None:
    return stacked_place(key) if isinstance(key, torch.Tensor) else None
