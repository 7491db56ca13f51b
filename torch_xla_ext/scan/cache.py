"""The cache of traced scan bodies: when two calls may share a trace, and a
thread-safe LRU map from a call's key to its `Traced`.

A call's `fn` is keyed by a fingerprint of what can change the program it
traces, never by the function object: a lambda or closure made afresh at each
call from the same code over the same objects finds the earlier trace. The
tensors `fn` captures are found again on the new `fn` by access paths (closure
cell 0, then `.cell.weight`, say) recorded when it was traced. The cache holds
every object of a key weakly, so it keeps no function, module or tensor alive,
and an entry is dropped once one of them dies.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import numbers
import threading
import types
import warnings
import weakref
from typing import Any, NamedTuple

import torch

from torch_xla_ext.diagnostics import ScanCacheWarning
from torch_xla_ext.scan.avals import Aval, Structure
from torch_xla_ext.object_graph import VALUE_TYPES, children, describe, find_paths
from torch_xla_ext.scan.nested import fake_tensors_active
from torch_xla_ext.scan.tracing import liftable


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    size: int
    maxsize: int
    # Entries of the stores kept beside the cache (`BoundedStore`: the call
    # plans of stacked layers, one per kind of call, with their stand-ins).
    plans: int = 0


class CacheKey(NamedTuple):
    fn: Any  # fingerprint(fn); None when fn is traced at every call
    partition_fn: Any  # fingerprint(partition_fn)
    carry_tree: Structure
    xs_tree: Structure
    carry_avals: tuple
    x_avals: tuple
    autocast: tuple  # the caller's autocast state, see autocast_state
    # The shardings of init's and xs' leaves under SPMD (sharding.operand_specs),
    # which the loops keep.
    carry_specs: tuple
    x_specs: tuple
    # A nested scan's (see `nested`): every floating input and capture counts
    # as requiring grad, so that the outer trace and its differentiation, which
    # give them other requires_grad flags, share one trace; its loops keep no
    # shardings of their own (their specs are all "").
    nested: bool = False


def autocast_state() -> tuple:
    """The caller's autocast state as `(device_type, dtype)` for each device
    type with autocast enabled: part of a trace's cache key, since it decides
    the dtypes of fn's ops."""
    return tuple((device, torch.get_autocast_dtype(device))
                 for device in torch._C._autocast_supported_devices()
                 if torch.is_autocast_enabled(device))


class WeakIdentity:
    """An object in a key by identity, held weakly. Equal only to a
    `WeakIdentity` of the same living object, so an entry whose object died never
    matches a newcomer that reuses its id."""
    __slots__ = ("ref", "_hash")

    def __init__(self, obj):
        self.ref = weakref.ref(obj)
        self._hash = id(obj)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if not isinstance(other, WeakIdentity):
            return NotImplemented
        obj = self.ref()
        return obj is not None and obj is other.ref()

    def __repr__(self):
        return f"WeakIdentity({self.ref()!r})"


# Most closure values are of these exact types, checked first. Numbers other
# than these are keyed by their repr, so that NaN equals itself and -0.0
# differs from 0.0.
_EXACT_VALUE_TYPES = frozenset(VALUE_TYPES) - {float, complex, enum.Enum}


class _Unkeyable(Exception):
    """`fingerprint` met an object it can neither compare by value nor hold weakly."""

    def __init__(self, obj):
        super().__init__(obj)
        self.obj = obj


def fingerprint(fn, name: str = "fn", nested: bool = False):
    """What about `fn` can change the program it traces, as a hashable key that
    holds every object weakly, or None (with a warning) when `fn` holds
    something that cannot be keyed soundly, so that `fn` is traced at every call.

    - functions: their code (by identity), defaults, keyword defaults and
      closure cells; `functools.partial`: its function, args and keywords; bound
      methods: the function and the bound object; weak references: the object
      they refer to; tuples, lists, dicts and sets: their type and items; all
      recursively. (The very function object of an earlier call also matches
      whatever its lists, dicts and sets now hold: see `same_fn_key`.)
    - plain constants (numbers, strings, None, dtypes, devices, enums, ...): by
      type and value, so that True, 1 and 1.0 differ.
    - XLA tensors: by type and aval (shape, dtype, requires_grad), so that a new
      tensor of the same aval shares the trace and is read at that call. Other
      tensors (on the host, or wrappers that `tracing.liftable` leaves alone)
      are baked into the trace as constants: by identity.
    - `nn.Module`s: by identity, and the `training` flags of the module and its
      submodules (`model.eval()` changes what dropout traces). Other attributes
      of a module are assumed unchanged between calls.
    - bare `object()` sentinels: by identity (they hold nothing).
    - any other object: by identity, held weakly; one that cannot be referenced
      weakly by its attributes if it is a SimpleNamespace or a dataclass, else
      it makes `fn` unkeyable.
    Globals that `fn` reads are not part of the key. `nested` (a nested scan's
    key, see `CacheKey.nested`): the XLA tensors a trace lifts by shape and dtype
    alone, since the outer step's differentiation gives them other classes
    (fake ones) and requires_grad flags than the outer trace.
    """
    try:
        return _fingerprint(fn, set(), True, nested)
    except _Unkeyable as error:
        path = find_paths(fn, [error.obj])[0]
        where = f"{name}{describe(fn, path)}" if path is not None else f"an object {name} holds"
        warnings.warn(
            f"scan: {where} is a {type(error.obj).__name__}, which scan can neither compare by "
            f"value nor reference weakly, so it cannot tell whether a later call's {name} traces "
            f"the same program; {name} is traced at every call, as with is_fn_pure=False. Give "
            f"the class a '__weakref__' slot, or hold plain constants or tensors instead.",
            ScanCacheWarning, stacklevel=3)
        return None


def same_fn_key(key: CacheKey, fn) -> CacheKey | None:
    """`key` for this very `fn` object regardless of what its lists, dicts and
    sets hold, or None if `fn` cannot be referenced weakly: a list `fn` appends
    to as a side effect changes between its calls, and must not make the same
    function object trace again."""
    try:
        identity = WeakIdentity(fn)
    except TypeError:
        return None
    return key._replace(fn=(identity, _fingerprint(fn, set(), False, key.nested)))


_MUTABLE_CONTAINERS = (list, dict, set)


def _is_record(value) -> bool:
    """Whether `value` is an object whose state is its attributes and that
    cannot be referenced weakly (a SimpleNamespace, a dataclass with
    `__slots__`): keyed by its attributes, like a dict."""
    return type(value).__weakrefoffset__ == 0 and (
        isinstance(value, types.SimpleNamespace)
        or dataclasses.is_dataclass(value) and not isinstance(value, type))


def _fingerprint(value, active: set, contents: bool, nested: bool):
    """`contents=False` leaves out what mutable containers and records hold."""
    if type(value) in _EXACT_VALUE_TYPES:
        return type(value), value
    if isinstance(value, numbers.Number):
        return type(value), repr(value)
    if isinstance(value, VALUE_TYPES):
        return type(value), value
    if isinstance(value, torch.Tensor):
        if nested and (liftable(value) or fake_tensors_active() and value.device.type == "xla"):
            return "xla tensor", tuple(value.shape), value.dtype
        if liftable(value):
            return type(value), Aval.of(value)
        return type(value), WeakIdentity(value)
    if isinstance(value, torch.nn.Module):
        return WeakIdentity(value), tuple(m.training for m in value.modules())
    if type(value) is object:
        return object, value
    record = _is_record(value)
    if not contents and (record or isinstance(value, _MUTABLE_CONTAINERS)):
        return type(value), "contents left out"
    if record or isinstance(value, (types.FunctionType, functools.partial, types.MethodType,
                                    weakref.ref, tuple, frozenset, slice, *_MUTABLE_CONTAINERS)):
        if id(value) in active:  # a function or container that reaches itself
            return "recursion", type(value)
        active.add(id(value))
        try:
            return _fingerprint_of_items(value, active, contents, nested)
        finally:
            active.discard(id(value))
    try:
        return WeakIdentity(value)
    except TypeError:
        raise _Unkeyable(value) from None


def _fingerprint_of_items(value, active: set, contents: bool, nested: bool):
    items = ((step.kind, _fingerprint(step.key, active, contents, nested),
              _fingerprint(child, active, contents, nested)) for step, child in children(value))
    if isinstance(value, (set, frozenset)):
        return type(value), frozenset(items)
    head = WeakIdentity(value.__code__) if isinstance(value, types.FunctionType) else None
    return type(value), head, tuple(items)


def _weak_identities(key):
    if isinstance(key, WeakIdentity):
        yield key
    elif isinstance(key, (tuple, frozenset)):
        for part in key:
            yield from _weak_identities(part)


class _Entry(NamedTuple):
    traced: Any
    watchers: list  # weak references whose callbacks report deaths of the key's objects
    alias: CacheKey | None  # its `same_fn_key`


class TraceCache:
    """A thread-safe LRU map from `CacheKey` to `Traced`, plus, per entry, its
    `same_fn_key` for the function object that was traced. An entry goes when
    an object its key holds weakly dies (at the next use of the cache)."""

    def __init__(self, maxsize: int = 256):
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._aliases: dict = {}  # same_fn_key -> (key, watchers)
        # (table, key) whose objects died; a deque, since garbage collection
        # may append at any moment, even while this thread holds the lock.
        self._dead: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._maxsize = maxsize
        self._hits = self._misses = 0

    def lookup(self, key: CacheKey, fn):
        """`(traced, captures)` for a call of `fn` with `key`, or None (a miss)
        when no trace matches or the tensors `fn` captures cannot be bound."""
        with self._lock:
            self._drop_dead()
            traced = self._touch(key)
            try_alias = traced is None and bool(self._aliases)
        if try_alias:
            alias = same_fn_key(key, fn)
            with self._lock:
                target = self._aliases.get(alias) if alias is not None else None
                traced = self._touch(target[0]) if target is not None else None
        # Outside the lock: binding follows attributes of user objects.
        captures = traced.bind_captures(fn) if traced is not None else None
        with self._lock:
            if captures is None:
                self._misses += 1
                return None
            self._hits += 1
        return traced, captures

    def store(self, key: CacheKey, traced, fn) -> None:
        alias = same_fn_key(key, fn)
        with self._lock:
            self._drop_dead()
            self._remove(key)  # so that the entry's key is this one, which the watchers name
            self._entries[key] = _Entry(traced, self._watch("entry", key), alias)
            if alias is not None:
                self._aliases[alias] = (key, self._watch("alias", alias))
            while len(self._entries) > self._maxsize:
                self._remove(next(iter(self._entries)))

    @property
    def maxsize(self) -> int:
        """How many traces it keeps; each `BoundedStore` keeps as many entries."""
        return self._maxsize

    @maxsize.setter
    def maxsize(self, maxsize: int) -> None:
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"the scan cache's maxsize must be an int of 1 or more, "
                             f"got {maxsize!r}")
        with self._lock:
            self._maxsize = maxsize
            while len(self._entries) > self._maxsize:
                self._remove(next(iter(self._entries)))

    def info(self) -> CacheInfo:
        plans = sum(len(store) for store in list(_STORES))
        with self._lock:
            self._drop_dead()
            return CacheInfo(self._hits, self._misses, len(self._entries), self._maxsize, plans)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._aliases.clear()
            self._dead.clear()
            self._hits = self._misses = 0
        for store in list(_STORES):
            store.clear()

    def _touch(self, key):
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.traced

    def _watch(self, table: str, key) -> list:
        report = functools.partial(self._dead.append, (table, key))
        return [weakref.ref(identity.ref(), lambda _: report())
                for identity in _weak_identities(key) if identity.ref() is not None]

    def _remove(self, key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and entry.alias is not None:
            target = self._aliases.get(entry.alias)
            if target is not None and target[0] == key:  # not re-pointed by a later entry
                del self._aliases[entry.alias]

    def _drop_dead(self) -> None:
        while self._dead:
            table, key = self._dead.popleft()
            if table == "entry":
                self._remove(key)
            else:
                self._aliases.pop(key, None)


CACHE = TraceCache()


class BoundedStore:
    """A thread-safe map kept beside the trace cache, of what is derived from
    calls by their kind (a stacked list's call plans and the stand-ins they
    hand out): at most `CACHE.maxsize` entries, the least recently used
    dropped first, and emptied by `cache_clear()`, so that a model called
    with ever new shapes holds no more than the cache does. `cache_info()`
    counts its entries as `plans`."""

    def __init__(self):
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        _STORES.add(self)

    # A copy (of a model, deep-copied or unpickled) holds copies of the
    # entries, with a lock of its own, and counts in `cache_info()`.
    def __getstate__(self) -> dict:
        with self._lock:
            return {"entries": collections.OrderedDict(self._entries)}

    def __setstate__(self, state: dict) -> None:
        self._entries = state["entries"]
        self._lock = threading.Lock()
        _STORES.add(self)

    def get(self, key):
        """The entry for `key`, now the most recently used, or None."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def peek(self, key):
        """The entry for `key`, or None, leaving the order as it is: for code
        that Dynamo traces, which cannot enter a lock."""
        return self._entries.get(key)

    def put(self, key, value) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > CACHE.maxsize:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def values(self) -> list:
        with self._lock:
            return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries


_STORES: "weakref.WeakSet[BoundedStore]" = weakref.WeakSet()
