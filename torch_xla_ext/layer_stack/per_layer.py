"""Per-layer attributes: values that may differ between layers (transformers'
`layer_idx`), each layer keeping its own. While the template layer runs in a
trace, reading one of them is recorded, and the trace goes on with the
template's own value: a trace that read one is refused once it ends
(`read_refusal`), before the scan runs, so that a scan only ever stands for
layers whose computation does not depend on them. Nothing is raised in the
layer's code, which no `except` of its own can then mislead."""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterable

from torch import nn

from torch_xla_ext.class_swaps import lookalike_subclass, swapped

# transformers' attention layers keep their index only to pick their key/value cache slot.
DEFAULT_PER_LAYER_ATTRIBUTES = ("layer_idx",)

# What a scan's step gives a layer where the forward passes each layer its
# own index as an argument: an opaque value, as a per-layer attribute's.
INDEX_ARGUMENT = "the index argument the forward passes each layer"


class _ReadLog(threading.local):
    # The set that the running step records per-layer attribute reads in, if any.
    reads: set | None = None
    # Whether a read gives an OpaqueValue, recorded only when it is used.
    opaque: bool = False


_READ_LOG = _ReadLog()


@contextlib.contextmanager
def reads_recorded_in(reads: set, opaque: bool = False):
    """While the block runs, per-layer attribute reads of a watched template
    are added to `reads`; with `opaque`, a read gives an `OpaqueValue`, and
    only a use of it is added."""
    outer = _READ_LOG.reads, _READ_LOG.opaque
    _READ_LOG.reads, _READ_LOG.opaque = reads, opaque
    try:
        yield
    finally:
        _READ_LOG.reads, _READ_LOG.opaque = outer


class OpaqueValue:
    """A per-layer attribute's value inside a trace, for a layer that only hands
    it on (`cache.update(k, v, self.layer_idx)`, to a cache that ignores it):
    the traced computation cannot depend on it. Any use of it (a comparison, an
    index, arithmetic, ...) is recorded, as reading the attribute is without a
    recording cache, and gives what the same use of `stand_in` (the template's
    own value) gives, so that the trace goes on to its end, to be refused."""
    __slots__ = ("_name", "_reads", "_stand_in")

    def __init__(self, name: str, reads: set, stand_in=0):
        self._name, self._reads, self._stand_in = name, reads, stand_in

    def __getattr__(self, attribute):
        self._reads.add(self._name)
        return getattr(self._stand_in, attribute)

    def __repr__(self):
        return f"<the per-layer {self._name} of the layer being traced>"


def _recorded_use(method: str):
    def use(self, *args, **kwargs):
        self._reads.add(self._name)
        return getattr(self._stand_in, method)(*args, **kwargs)
    use.__name__ = method
    return use


for _method in ("__index__", "__int__", "__float__", "__bool__", "__hash__", "__eq__", "__ne__",
                "__lt__", "__le__", "__gt__", "__ge__", "__add__", "__radd__", "__sub__",
                "__rsub__", "__mul__", "__rmul__", "__mod__", "__str__", "__format__",
                "__getitem__", "__iter__", "__len__", "__call__", "__contains__"):
    setattr(OpaqueValue, _method, _recorded_use(_method))
del _method


def read_refusal(reads: set, per_layer_paths: tuple[str, ...]) -> str | None:
    """Why a trace that recorded `reads` cannot stand for every layer, or None."""
    read = [path for path in per_layer_paths if path.rpartition(".")[2] in reads] + [
        name for name in (INDEX_ARGUMENT,) if name in reads]
    if not read:
        return None
    return (f"the layer reads {read}, which differ between layers, so one trace cannot stand "
            f"for all of them (a key/value cache passed to the layers reads its layer index)")


class _WatchedAttribute:
    """Stands in the class for a per-layer attribute while a call runs: a data
    descriptor, so it sees every attribute read of the instance's own value."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        try:
            value = instance.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None
        if _READ_LOG.reads is None:
            return value
        if _READ_LOG.opaque:
            return OpaqueValue(self.name, _READ_LOG.reads, value)
        _READ_LOG.reads.add(self.name)
        return value

    def __set__(self, instance, value):
        instance.__dict__[self.name] = value

    def __delete__(self, instance):
        del instance.__dict__[self.name]


@functools.cache
def _watching_class(cls: type, names: frozenset[str]) -> type:
    """A look-alike subclass of `cls` watching the attributes `names`."""
    return lookalike_subclass(cls, {name: _WatchedAttribute(name) for name in names})


# Serializes the class swaps of templates (a template is swapped by one call at a time).
_WATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def reads_watched(template: nn.Module, per_layer_paths: Iterable[str]):
    """While the block runs, the template's per-layer attributes are watched: a
    step that runs the template records those it reads (`reads_recorded_in`)."""
    names_by_owner: dict[str, set[str]] = {}
    for path in per_layer_paths:
        owner_path, _, name = path.rpartition(".")
        names_by_owner.setdefault(owner_path, set()).add(name)
    if not names_by_owner:
        yield
        return
    with _WATCH_LOCK, contextlib.ExitStack() as swaps:
        for owner_path, names in names_by_owner.items():
            owner = template.get_submodule(owner_path)
            swaps.enter_context(swapped(owner, _watching_class(type(owner), frozenset(names))))
        yield
