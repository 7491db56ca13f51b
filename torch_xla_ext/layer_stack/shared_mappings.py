"""Mappings that a forward passes to every layer call, whose entries the
layers read and write (Gemma 4's key/value states that later layers reuse:
a `UserDict`, which pytree keeps as one leaf).

How the other modules treat such a mapping:

* the dry run (`dry_run`) sees which layer calls write which entries: a
  layer's fake run gets a copy, and what the layer put in it is written
  into the forward's own mapping as placeholders, so that later layers
  find the entries there; the mapping is put back as it was afterwards;
* the call plan (`planner`) takes every entry present at a layer's call
  as read by it: a layer that writes entries runs as itself, never inside
  a scan, since the scan's layers all see the mapping as it was when the
  scan began;
* a scan (`scan_runner`) takes the entries present as tensor arguments that
  ride the carry unchanged, and hands each step's layer the very mapping
  object holding the traced entries (`gathered`, `holding`); a layer that
  writes one makes the call run layer by layer.
"""
from __future__ import annotations

import contextlib
from collections.abc import MutableMapping

from torch.utils._pytree import tree_unflatten

__all__ = ["gathered", "holding", "is_shared_mapping", "written_keys"]


def is_shared_mapping(leaf) -> bool:
    """Whether a leaf of a layer call's arguments is a mapping the layers
    share (pytree flattens dicts; a mapping of another class stays a leaf)."""
    return isinstance(leaf, MutableMapping)


def written_keys(before: dict, mapping: MutableMapping) -> list:
    """The keys whose entries a layer set (added or replaced) or deleted in
    `mapping`, which held `before` when it was called."""
    return [key for key in {**before, **mapping}
            if key not in mapping or key not in before or mapping[key] is not before[key]]


def gathered(values: list, marker, mappings: list) -> tuple[list, list]:
    """A scan step's call leaves from its `values`, where each shared mapping
    stands as `(marker, entry count, entries' spec)` followed by its
    entries' leaves: each mapping the very object of the call being traced
    (`mappings`: (mapping, argument path) in order); and (mapping, path,
    traced entries) of each, for `holding`."""
    leaves, filled, given, position = [], [], iter(mappings), 0
    while position < len(values):
        value = values[position]
        position += 1
        if isinstance(value, tuple) and value and value[0] is marker:
            _, count, entries_spec = value
            mapping, path = next(given)
            if not any(mapping is each for each, _, _ in filled):  # given to a group's layers
                filled.append((mapping, path,
                               tree_unflatten(values[position:position + count], entries_spec)))
            position += count
            value = mapping
        leaves.append(value)
    return leaves, filled


@contextlib.contextmanager
def holding(filled: list):
    """Each mapping of `filled` (of `gathered`) holding its traced entries
    only, its own put back afterwards; yields a list that then holds
    (path, written keys) of each mapping the body wrote."""
    written, own = [], [dict(mapping.items()) for mapping, _, _ in filled]
    try:
        for mapping, _, entries in filled:
            mapping.clear()
            mapping.update(entries)
        yield written
        written += [(path, keys) for mapping, path, entries in filled
                    if (keys := written_keys(entries, mapping))]
    finally:
        for (mapping, _, _), entries in zip(filled, own):
            mapping.clear()
            mapping.update(entries)
