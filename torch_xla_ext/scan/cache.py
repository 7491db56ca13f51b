"""The cache of traced scan bodies: a thread-safe LRU map from a call's key
(fn, partitioner, input structures and avals) to its `Traced`."""
from __future__ import annotations

import collections
import threading
from typing import Any, NamedTuple

from torch_xla_ext.scan.avals import Structure


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    size: int
    maxsize: int


class CacheKey(NamedTuple):
    fn: Any
    partition_fn: Any
    carry_tree: Structure
    xs_tree: Structure
    carry_avals: tuple
    x_avals: tuple


class TraceCache:
    """A thread-safe LRU map from `CacheKey` to `Traced`."""

    def __init__(self, maxsize: int = 256):
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._maxsize = maxsize
        self._hits = self._misses = 0

    def lookup(self, key: CacheKey):
        with self._lock:
            traced = self._entries.get(key)
            if traced is not None and traced.captures_still_match():
                self._entries.move_to_end(key)
                self._hits += 1
                return traced
            self._misses += 1
            return None

    def store(self, key: CacheKey, traced) -> None:
        with self._lock:
            self._entries[key] = traced
            self._entries.move_to_end(key)
            while len(self._entries) > self._maxsize:
                self._entries.popitem(last=False)

    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._entries), self._maxsize)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._hits = self._misses = 0


CACHE = TraceCache()

