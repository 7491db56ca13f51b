"""State a layer keeps on its own modules: attributes it sets while it runs
(a recurrent block's convolution and recurrence states, which its next call
reads; dropout seeds that its own backward reads).

An unconverted layer is one module object, whose attributes last from call
to call; a `StackedList`'s layer is built from its segment's template at
each access. So:

* `attributes_of` / `written`: which attributes of a layer's modules a
  call set (added, replaced or deleted), other than `nn.Module`'s own
  bookkeeping; `attributes_restored`: the same, the attributes put back
  afterwards (the dry run's fake runs leave nothing on a module);
* `KeptLayers`: per layer, the module of a layer that set attributes on
  itself in a call, which the stack gives as that layer from then on (its
  tensors pointed at the stack's at each access, its mode the template's),
  so that the state lasts as the unconverted layer's does. A copy or pickle
  of the stack keeps each layer's written attributes, set again on the
  layer's module at its first access.

A scan's steps all run one template, so it cannot keep such state per
layer: the call plan runs layers that set attributes one by one (`planner`).
"""
from __future__ import annotations

import contextlib

from torch import nn

from torch_xla_ext.object_graph import VALUE_TYPES

__all__ = ["KeptLayers", "attributes_of", "attributes_restored", "written"]

# What nn.Module keeps in a module's __dict__ for itself (registries, hooks, mode).
_BOOKKEEPING = frozenset(vars(nn.Module()))


def attributes_of(layer: nn.Module) -> dict[str, object]:
    """The attributes of `layer`'s modules, by path ('temporal_block.conv1d_state')."""
    return {f"{path}.{name}" if path else name: value
            for path, module in layer.named_modules(remove_duplicate=False)
            for name, value in vars(module).items() if name not in _BOOKKEEPING}


def written(before: dict, after: dict) -> tuple[str, ...]:
    """The paths of the attributes set or deleted between two `attributes_of`
    (an equal plain value set again counts as unchanged)."""
    return tuple(sorted(path for path in before.keys() | after.keys()
                        if path not in before or path not in after
                        or not _same(before[path], after[path])))


def _same(value, other) -> bool:
    return value is other or (isinstance(value, VALUE_TYPES) and type(value) is type(other)
                              and value == other)


@contextlib.contextmanager
def attributes_restored(layer: nn.Module):
    """Yields a list that then holds the paths of the attributes the block
    set on `layer`'s modules (`written`); puts every one back as it was."""
    modules = [module for _, module in layer.named_modules(remove_duplicate=False)]
    own = [{name: value for name, value in vars(module).items() if name not in _BOOKKEEPING}
           for module in modules]
    before = attributes_of(layer)
    paths: list[str] = []
    try:
        yield paths
        paths += written(before, attributes_of(layer))
    finally:
        for module, attributes in zip(modules, own):
            for name in [name for name in vars(module) if name not in _BOOKKEEPING]:
                if name not in attributes:
                    del module.__dict__[name]
            module.__dict__.update(attributes)


class KeptLayers:
    """The modules of a stack's layers that set attributes on themselves, by
    layer index (see the module docstring)."""

    def __init__(self):
        self.modules: dict[int, nn.Module] = {}
        self.paths: dict[int, set[str]] = {}  # the attributes each set, by path
        # Attributes to set at a layer's first access, by index: a copy's or unpickled.
        self.pending: dict[int, dict[str, object]] = {}

    def keep(self, index: int, layer: nn.Module, paths: tuple[str, ...]) -> None:
        """Keeps `layer`, which set the attributes `paths`, as layer `index`."""
        self.modules[index] = layer
        self.paths.setdefault(index, set()).update(paths)

    def layer(self, index: int, built: nn.Module, copied: bool) -> nn.Module:
        """Layer `index` as the stack gives it, `built` from its template:
        the kept module, its tensors and mode `built`'s; a `copied` layer is
        `built` with the attributes the kept one set."""
        kept = self.modules.get(index)
        if kept is built:  # a layer the stack holds as itself
            return built
        if copied:
            _set(built, self.pending.get(index) or (self.values(index) if kept else {}))
            return built
        if index in self.pending:
            values = self.pending.pop(index)
            _set(built, values)
            self.keep(index, built, tuple(values))
            return built
        if kept is None:
            return built
        for (_, source), (_, target) in zip(built.named_modules(remove_duplicate=False),
                                            kept.named_modules(remove_duplicate=False)):
            target._parameters.update(source._parameters)
            target._buffers.update(source._buffers)
            target.training = source.training
        return kept

    def values(self, index: int) -> dict[str, object]:
        """The current values of the attributes layer `index` set, by path."""
        attributes = attributes_of(self.modules[index])
        return {path: attributes[path] for path in sorted(self.paths[index]) if path in attributes}

    def __getstate__(self) -> dict:
        return {"pending": {**self.pending, **{index: self.values(index) for index in self.modules}}}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
        self.pending = state["pending"]


def _set(layer: nn.Module, values: dict[str, object]) -> None:
    for path, value in values.items():
        owner_path, _, name = path.rpartition(".")
        setattr(layer.get_submodule(owner_path), name, value)
