"""Stacked layers as code outside the owner's forward addresses them.

`layers[3]`, `get_submodule("model.layers.3")`, `modules()` or iterating
the list give the layer itself, whose tensors are views of its slices of
the stacked ones (`storage`). The scans run the stacked tensors through
the stack's own copy of the layer, so a module hook on a layer (or on one
of its submodules), or a tensor hook on one of its Parameters, would not
run inside them. A `StackedList` watches its layers' hooks instead
(`HookWatch`): a layer with a hook its template does not replay runs as
itself, outside the scans (the call plan reads `HookWatch.hooked`), so the
hook runs as unconverted, with the layer's own values, whether it was
registered before converting or after; once it is removed the layer scans
again. A `LayerStack`, which has no plan and scans every layer, refuses
module hooks on its items with a ValueError that says why and what to do
(`refusing_hooks`). Likewise the list refuses what would replace, add or
delete a layer (`RefusedEdits`): its stacks would go on running the old
layers.
"""
from __future__ import annotations

import collections
from typing import Callable

from torch import nn

__all__ = ["HookWatch", "RefusedEdits", "refusing_hooks", "strip_hooks"]

# Where a module keeps the hooks each registration adds (torch's own
# attributes): forward hooks and pre-hooks, full backward hooks and pre-hooks.
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class HookWatch:
    """Which of a list's layers have hooks of their own: module hooks that
    `replayed` does not take as its templates' own (those run after the
    scan, `hooks`), or tensor hooks on its Parameters (a scan computes
    their gradients as slices of the stacked one). The layers keep their own
    hook dicts, so that a handle made before converting still removes its
    hook; a call compares the hooks' counts with the last look's (a
    registration or a removal changes one), some tens of microseconds for a
    deep model."""

    def __init__(self):
        self._dicts, self._sizes, self._hooked = None, None, ()

    def hooked(self, layers: list[nn.Module], replayed: Callable[[Callable], bool]
               ) -> tuple[int, ...]:
        """The indices of the layers that must run as themselves."""
        if self._dicts is None:
            self._dicts = [[module.__dict__[name] for module in layer.modules()
                            for name in _HOOK_DICTS] for layer in layers]
            self._flat = [hooks for dicts in self._dicts for hooks in dicts]
            self._params = [list(layer.parameters()) for layer in layers]
            self._flat_params = [param for params in self._params for param in params]
        sizes = tuple(map(len, self._flat)), tuple(map(_tensor_hooks, self._flat_params))
        if sizes != self._sizes:
            self._sizes, self._hooked = sizes, tuple(
                index for index, (dicts, params) in enumerate(zip(self._dicts, self._params))
                if any(not replayed(hook) for hooks in dicts for hook in hooks.values())
                or any(map(_tensor_hooks, params)))
        return self._hooked

    def forget(self) -> None:
        """Makes the next `hooked` find the dicts again (a module or a hook
        dict of a layer may have been replaced)."""
        self._dicts = None


def _tensor_hooks(param) -> int:
    """How many gradient hooks (`register_hook`, `..._post_accumulate_grad_hook`) `param` has."""
    return len(param._backward_hooks or ()) + len(param._post_accumulate_grad_hooks or ())


def strip_hooks(template: nn.Module, replayed: Callable[[Callable], bool]) -> None:
    """Takes from a stack's template, a copy of its first layer, every hook
    `replayed` does not keep: a hook of one layer runs on that layer."""
    for module in template.modules():
        for name in _HOOK_DICTS:
            hooks = module.__dict__[name]
            for key in [key for key, hook in hooks.items() if not replayed(hook)]:
                del hooks[key]


def refusing_hooks(layer: nn.Module, index: int) -> nn.Module:
    """`layer`, layer `index` of a `LayerStack`, with new hooks on it and its
    submodules refused; returns it. Its class is its own (code checks
    `type(layer) is ...`): what refuses is each module's hook dicts, which
    every registration writes before anything else."""
    for path, module in layer.named_modules():
        where = f"layer {index}" + (f"'s {path}" if path else "")
        for name in _HOOK_DICTS:
            module.__dict__[name] = _RefusingHooks(where, module.__dict__[name])
    return layer


class _RefusingHooks(collections.OrderedDict):
    """A module's hook dict that takes no new hook, saying why."""

    def __init__(self, where: str, hooks):
        super().__init__()
        self.where = where
        for key, hook in hooks.items():  # the hooks it had stay
            super().__setitem__(key, hook)

    def __setitem__(self, key, hook) -> None:
        raise ValueError(
            f"{self.where} of the stacked layers runs inside a scan of the stacked weights "
            f"through one copy of the layer, so a hook on it would never run. To hook a "
            f"layer, stack the layers as a StackedList (a layer with hooks of its own runs "
            f"as itself there) or run them unconverted, or hook the stack itself, whose "
            f"hooks run as before")

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
