"""Stacked layers as code outside the owner's forward addresses them.

`layers[3]`, `get_submodule("model.layers.3")` or iterating the list outside
the owner's forward gives a module of the layer's class whose tensors are
views of its slices of the stacked ones, made for that access
(`LayerStack.layer`). The scans run the stacked tensors through the stack's
own copy of the layer, never through such a module, so a hook put on it (or
on one of its submodules) would never run. Rather than let it be dropped
without a word, its hook registrations raise a ValueError that says so and
what to do (`addressed`); everything else about it (reading its settings and
weights, calling it) is as before. Likewise the list refuses what would
replace, add or delete a layer (`RefusedEdits`): its stacks would go on
running the old layers.
"""
from __future__ import annotations

import functools
import weakref

from torch import nn

from torch_xla_ext.class_swaps import lookalike_subclass, swap_in

__all__ = ["RefusedEdits", "addressed"]

_REGISTRATIONS = ("register_forward_hook", "register_forward_pre_hook",
                  "register_full_backward_hook", "register_full_backward_pre_hook",
                  "register_backward_hook")
# What each addressed module is, for the refusal's message ("layer 3's mlp").
_DESCRIPTIONS: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def addressed(layer: nn.Module, index: int) -> nn.Module:
    """`layer`, a module made for an access of layer `index`, with the hook
    registrations of it and its submodules refused; returns it."""
    for path, module in layer.named_modules():
        _DESCRIPTIONS[module] = f"layer {index}" + (f"'s {path}" if path else "")
        swap_in(module, _refusing_hooks(type(module)))
    return layer


@functools.cache
def _refusing_hooks(cls: type) -> type:
    return lookalike_subclass(cls, {name: _refusal(name) for name in _REGISTRATIONS})


def _refusal(name: str):
    def refuse(self, *args, **kwargs):
        raise ValueError(
            f"{name}: {_DESCRIPTIONS.get(self, 'this module')} of the stacked layers is a "
            f"module made for this access, whose tensors are views of the stacked weights: a "
            f"hook on it would never run, since each scan runs the stacked weights through "
            f"one copy of the layer. To hook a layer, run the model unconverted "
            f"(unstack_layers(model)), or hook the stack's owner, whose hooks run as before")
    refuse.__name__ = refuse.__qualname__ = name
    return refuse


class RefusedEdits:
    """What would replace, add or delete a layer of an `nn.ModuleList`, each
    raising a TypeError that says why and what to do: the layers are stored
    stacked, and the stacks would go on running the old ones."""

    def __setitem__(self, index, layer) -> None:
        _refuse_edit(f"layers[{index!r}] = ...")

    def __delitem__(self, index) -> None:
        _refuse_edit(f"del layers[{index!r}]")

    def append(self, layer) -> None:
        _refuse_edit("layers.append(...)")

    def extend(self, layers) -> None:
        _refuse_edit("layers.extend(...)")

    def insert(self, index, layer) -> None:
        _refuse_edit(f"layers.insert({index!r}, ...)")

    def __setattr__(self, name: str, value) -> None:
        if name.isdigit():  # a layer by its name in the list, as setattr and peft set one
            _refuse_edit(f"setattr(layers, {name!r}, ...)")
        super().__setattr__(name, value)


def _refuse_edit(what: str):
    raise TypeError(
        f"{what}: the layers of a stacked list are stored stacked, and replacing, adding or "
        f"deleting one is not supported (the stacks would go on running the old layers); "
        f"unstack_layers(model), change the nn.ModuleList, then stack_layers(model) again")
