"""Whether the settings of stacked layers changed since their stack read them.

A stack runs its layers' code through its template, with the settings it
read from the layers when it was built (`alike.layout_of`). The layers
stay in the module tree, where code may change a setting of one of them
or of a submodule (transformers' `disable_adapters()` sets each LoRA
module's `_disable_adapters`; a user sets a dropout's `p`). A stack that
went on with the settings it read would ignore that without a word, so
before each call it asks `SettingsSnapshot.changed` and, if so, reads them
again (`StackedList.settings_key`). The check compares each module's
attributes by identity with what the last read saw, which is what setting
an attribute changes, and costs a few identity tests per attribute. What a
layer sets on itself while it runs as itself is its state, kept by the
layer (`layer_state`), and taken as seen once it ran.
"""
from __future__ import annotations

import operator

from torch import nn

from torch_xla_ext.layer_stack.alike import (LayerLayout, Refusal, layout_of, layouts_of,
                                             structure_key)
from torch_xla_ext.layer_stack.segments import Segment, plan_segments

__all__ = ["CurrentLayouts", "SettingsSnapshot", "layouts_again"]


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
