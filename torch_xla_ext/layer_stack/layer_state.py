"""State a layer keeps on its own modules: attributes it sets while it runs
(a recurrent block's convolution and recurrence states, which its next call
reads; dropout seeds that its own backward reads).

A `StackedList`'s layer is the module itself, whose attributes last from
call to call as unconverted; a scan runs its segment's template. So:

* `attributes_of` / `written`: which attributes of a layer's modules a
  call set (added, replaced or deleted), other than `nn.Module`'s own
  bookkeeping; `attributes_restored`: the same, the attributes put back
  afterwards (the dry run's fake runs leave nothing on a module);

A scan's steps all run one template, so it cannot keep such state per
layer: the call plan runs layers that set attributes one by one (`planner`).
"""
from __future__ import annotations

import contextlib

from torch import nn

from torch_xla_ext.object_graph import VALUE_TYPES

__all__ = ["attributes_of", "attributes_restored", "written"]

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
