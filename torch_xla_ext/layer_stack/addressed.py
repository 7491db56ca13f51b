"""Stacked layers as code outside the owner's forward addresses them.

`layers[3]`, `get_submodule("model.layers.3")`, `modules()` or iterating
the list give the layer itself, whose tensors are views of its slices of
the stacked ones (`storage`). The scans run the stacked tensors through
the stack's own copy of the layer, so a module hook put on a layer (or on
one of its submodules) would not run inside them. A `StackedList` watches
its layers' hook dicts instead (`addressed` with a `HookWatch`): a layer
that has hooks it did not have when it was stacked runs as itself, outside
the scans (`HookWatch.hooked`, which the call plan reads), so its hooks run
as unconverted, and removing them lets it scan again. A `LayerStack`,
which has no plan and scans every layer, refuses such hooks with a
ValueError that says why and what to do. Both are undone by `unaddressed`
when the layers leave the stack; everything else about a layer (its
class, reading and writing its settings and weights, calling it) is as
before. Likewise the list refuses what would replace, add or delete a
layer (`RefusedEdits`): its stacks would go on running the old layers.
"""
from __future__ import annotations

import collections

from torch import nn

__all__ = ["HookWatch", "RefusedEdits", "addressed", "unaddressed"]

# Where a module keeps the hooks each registration adds (torch's own
# attributes): forward hooks and pre-hooks, full backward hooks and pre-hooks.
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class HookWatch:
    """Counts the changes of the hook dicts that share it (one list's
    layers), and keeps which layers have hooks of their own as of the last
    change."""

    def __init__(self):
        self.version, self._read, self._hooked = 0, None, ()

    def hooked(self, layers: list[nn.Module]) -> tuple[int, ...]:
        """The indices of the layers with module hooks that they did not have
        when stacked (a plain hook dict, set in place of a watched one, counts
        all its hooks): the layers that must run as themselves."""
        if self._read != self.version:
            self._read, self._hooked = self.version, tuple(
                index for index, layer in enumerate(layers)
                if any(hooks.added() if isinstance(hooks, _WatchedHooks) else hooks
                       for module in layer.modules()
                       for hooks in map(module.__dict__.get, _HOOK_DICTS)))
        return self._hooked

    def forget(self) -> None:
        """Makes the next `hooked` look again (a hook dict may have been replaced)."""
        self._read = None


def addressed(layer: nn.Module, index: int, watch: HookWatch | None = None) -> nn.Module:
    """`layer`, layer `index` of a stack, with its and its submodules' hook
    dicts watched by `watch` (without one, refusing new hooks); returns it.
    Its class is its own (code checks `type(layer) is ...`): what watches is
    each module's hook dicts, which every registration and removal writes."""
    for path, module in layer.named_modules():
        where = f"layer {index}" + (f"'s {path}" if path else "")
        for name in _HOOK_DICTS:
            module.__dict__[name] = _WatchedHooks(where, module.__dict__[name], watch)
    return layer


def unaddressed(layer: nn.Module) -> nn.Module:
    """`layer` with plain hook dicts again; returns it."""
    for module in layer.modules():
        for name in _HOOK_DICTS:
            module.__dict__[name] = collections.OrderedDict(module.__dict__[name])
    return layer


class _WatchedHooks(collections.OrderedDict):
    """A module's hook dict that counts its changes in a `HookWatch`, or,
    without one, takes no new hook, saying why. The hooks it had when the
    layer was stacked (transformers' own, which the stack's template has
    too) are its `baseline`."""

    def __init__(self, where: str, hooks, watch: HookWatch | None, baseline=None):
        super().__init__()
        self.where, self.watch = where, watch
        for key, hook in hooks.items():
            super().__setitem__(key, hook)
        self.baseline = frozenset(self) if baseline is None else baseline

    def added(self) -> bool:
        return not self.keys() <= self.baseline

    def _changing(self) -> None:
        if self.watch is None:
            raise ValueError(
                f"{self.where} of the stacked layers runs inside a scan of the stacked weights "
                f"through one copy of the layer, so a hook on it would never run. To hook a "
                f"layer, convert the layers with StackedList (a layer with hooks of its own "
                f"runs as itself there) or run them unconverted, or hook the stack itself, "
                f"whose hooks run as before")
        self.watch.version += 1

    def __setitem__(self, key, hook) -> None:
        self._changing()
        super().__setitem__(key, hook)

    def __delitem__(self, key) -> None:
        self._changing()
        super().__delitem__(key)

    def pop(self, *args):
        self._changing()
        return super().pop(*args)

    def popitem(self, last: bool = True):
        self._changing()
        return super().popitem(last)

    def clear(self) -> None:
        self._changing()
        super().clear()

    def update(self, *args, **kwargs) -> None:
        self._changing()
        super().update(*args, **kwargs)

    def setdefault(self, key, default=None):
        self._changing()
        return super().setdefault(key, default)

    def __reduce__(self):
        # Copied or pickled with its list, it stays watched by the copy's watch;
        # a refusing one, with no list to run its layer as itself, is a plain dict.
        if self.watch is None:
            return collections.OrderedDict, (list(self.items()),)
        return _WatchedHooks, (self.where, dict(self.items()), self.watch, self.baseline)


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
