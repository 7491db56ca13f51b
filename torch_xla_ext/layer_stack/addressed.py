"""Stacked layers as code outside the owner's forward addresses them.

`layers[3]`, `get_submodule("model.layers.3")`, `modules()` or iterating
the list give the layer itself, whose tensors are views of its slices of
the stacked ones (`storage`). The scans run the stacked tensors through
the stack's own copy of the layer, so a module hook put on a layer (or on
one of its submodules) would not run. Rather than let it be dropped without
a word, its hook registrations raise a ValueError that says so and what to
do (`addressed`, undone by `unaddressed` when the layers leave the stack);
everything else about it (its class, reading and writing its settings and
weights, calling it) is as before. Likewise the list refuses what would
replace, add or delete a layer (`RefusedEdits`): its stacks would go on
running the old layers.
"""
from __future__ import annotations

import collections

from torch import nn

__all__ = ["RefusedEdits", "addressed", "unaddressed"]

# Where a module keeps the hooks each registration adds (torch's own
# attributes): forward hooks and pre-hooks, full backward hooks and pre-hooks.
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def addressed(layer: nn.Module, index: int) -> nn.Module:
    """`layer`, layer `index` of a stack, with hooks refused on it and its
    submodules; returns it. Its class is its own (code checks `type(layer)
    is ...`): what refuses is each module's hook dicts, which every
    registration writes before anything else."""
    for path, module in layer.named_modules():
        where = f"layer {index}" + (f"'s {path}" if path else "")
        for name in _HOOK_DICTS:
            module.__dict__[name] = _RefusingHooks(where, module.__dict__[name])
    return layer


def unaddressed(layer: nn.Module) -> nn.Module:
    """`layer` taking hooks again (its hook dicts plain ones); returns it."""
    for module in layer.modules():
        for name in _HOOK_DICTS:
            module.__dict__[name] = collections.OrderedDict(module.__dict__[name])
    return layer


class _RefusingHooks(collections.OrderedDict):
    """A module's hook dict that takes no new hook, saying why."""

    def __init__(self, where: str, hooks):
        super().__init__()
        self.where = where
        for key, hook in hooks.items():  # the hooks it had (transformers' own) stay
            super().__setitem__(key, hook)

    def __setitem__(self, key, hook) -> None:
        raise ValueError(
            f"{self.where} of the stacked layers runs inside a scan of the stacked weights "
            f"through one copy of the layer, so a hook on it would never run. To hook a "
            f"layer, run the model unconverted (unstack_layers(model)), or hook the stack's "
            f"owner, whose hooks run as before")

    def __reduce__(self):  # copied or pickled, a plain dict of hooks again
        return collections.OrderedDict, (list(self.items()),)


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
        # A layer by its name in the list, as setattr and peft set one (the
        # layer it holds, set again, changes nothing).
        if name.isdigit() and value is not self._modules.get(name):
            _refuse_edit(f"setattr(layers, {name!r}, ...)")
        super().__setattr__(name, value)


def _refuse_edit(what: str):
    raise TypeError(
        f"{what}: the layers of a stacked list are stored stacked, and replacing, adding or "
        f"deleting one is not supported (the stacks would go on running the old layers); "
        f"unstack_layers(model), change the nn.ModuleList, then stack_layers(model) again")
