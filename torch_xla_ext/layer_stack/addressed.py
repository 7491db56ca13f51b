"""Stacked layers as code outside the owner's forward addresses them: what
it sets on them is read again, what it hooks runs, what it cannot do is
refused.

Settings. A stack runs its layers' code through its template, with the
settings it read from the layers when it was built (`alike.layout_of`).
Code may change a setting of a layer or of a submodule (transformers'
`disable_adapters()` sets each LoRA module's `_disable_adapters`; a user
sets a dropout's `p`). A stack that went on with the settings it read
would ignore that without a word, so before each call it asks
`SettingsSnapshot.changed` and, if so, reads them again
(`StackedList.settings_key`). The check compares each module's attributes
by identity with what the last read saw, which is what setting an
attribute changes, and costs a few identity tests per attribute. What a
layer sets on itself while it runs as itself is its state, kept by the
layer (`layer_state`), and taken as seen once it ran.

Hooks. `layers[3]`, `get_submodule("model.layers.3")`, `modules()` or iterating
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
import operator
from typing import Callable

from torch import nn

from torch_xla_ext.layer_stack.alike import (LayerLayout, Refusal, layout_of, layouts_of,
                                             structure_key)
from torch_xla_ext.layer_stack.segments import Segment, plan_segments

__all__ = ["CurrentLayouts", "HookWatch", "RefusedEdits", "SettingsSnapshot", "layouts_again",
           "refusing_hooks", "strip_hooks"]

class SettingsSnapshot:
    """The attributes and children of every module of `layers`, as they are now."""

    def __init__(self, layers: list[nn.Module]):
        self.per_layer = [_entries_of(layer) for layer in layers]

    def changed(self) -> bool:
        """Whether an attribute of one of the modules was set, added or
        deleted, or a child replaced, added or deleted, since the snapshot."""
        for entries in self.per_layer:
            for attributes, keys, values, children, modules in entries:
                if (len(attributes) != len(keys) or len(children) != len(modules)
                        or not all(map(operator.is_, attributes.values(), values))
                        or not all(map(operator.is_, children.values(), modules))
                        or tuple(attributes.keys()) != keys):
                    return True
        return False

    def seen(self, index: int, layer: nn.Module) -> None:
        """Takes layer `index` as it is now: after it ran as itself, what it set
        on itself is its state (`layer_state`), not a changed setting."""
        self.per_layer[index] = _entries_of(layer)


class CurrentLayouts:
    """The layouts (`alike.layout_of`) of the templates a stack runs, each
    read again only when one of the template's attributes changed since
    (`SettingsSnapshot`), so that a call whose kind is planned reads no
    setting's form. Bounded by the templates the stack's kinds make."""

    def __init__(self):
        self._read: dict[int, tuple] = {}  # id(template) -> (template, snapshot, layout)

    def of(self, template: nn.Module) -> LayerLayout:
        entry = self._read.get(id(template))
        if entry is None or entry[0] is not template or entry[1].changed():
            entry = self._read[id(template)] = (template, SettingsSnapshot([template]),
                                                layout_of(template, 0))
        return entry[2]


def _entries_of(layer: nn.Module) -> list[tuple]:
    return [(module.__dict__, tuple(module.__dict__.keys()), tuple(module.__dict__.values()),
             module._modules, tuple(module._modules.values())) for module in layer.modules()]


def layouts_again(layers: list[nn.Module], plan: tuple[Segment, ...]) -> list[LayerLayout]:
    """The layers' layouts read again; a change of structure (a module added
    to a layer, replaced or taken away), which the stacks cannot follow,
    raises a ValueError naming the first layer changed."""
    layouts = layouts_of(layers)
    if isinstance(layouts, Refusal):
        raise layouts.exception()
    if plan_segments([structure_key(layout) for layout in layouts]) != tuple(plan):
        changed = next((f"layer {index}" for segment in plan
                        for index in range(segment.start, segment.stop)
                        if structure_key(layouts[index]) != structure_key(
                            layouts[segment.start + (index - segment.start) % segment.period])),
                       "a layer")
        raise ValueError(
            f"{changed} of the stacked layers changed in structure after they were "
            f"stacked (a module added, replaced or taken away): its stack holds the "
            f"layers as they were. Make the change before stack_layers(model), or "
            f"unstack_layers(model), change the layers, then stack_layers(model) again.")
    return layouts


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
