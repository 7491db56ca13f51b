"""What every change to another library does the same way: it is applied
once (however many threads ask at the same time), never at import, when the
library's module is imported (now if it is: nothing is imported to look), and
it can be undone by putting back what it replaced.

A `Patch` is a list of changes, each made by the library's module here:
`Replaced` (an attribute of the library's class or module replaced by a
wrapper of what it held), `Added` (classes added to a set the library
reads) and `Registered` (a hook given to one of the library's registration
functions). Undoing puts back the attributes' values (or removes an attribute
that was inherited), takes the classes out and removes the hooks, all or nothing: if another
library has replaced one of the attributes since, it holds a wrapper of ours,
so the patch stays.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, NamedTuple

from torch_xla_ext.on_import import when_imported


class Replaced(NamedTuple):
    """`owner.name` becomes `wrap(what it was)` (an inherited attribute is read
    as the owner's; undoing removes it again)."""
    owner: Any
    name: str
    wrap: Callable[[Any], Any]


class Added(NamedTuple):
    """`items` added to the set `collection` (those it did not hold)."""
    collection: set
    items: tuple


class Registered(NamedTuple):
    """`register(hook)` called; undoing removes the hook through the handle
    it returned (torch's `RemovableHandle`)."""
    register: Callable[[Callable], Any]
    hook: Callable


_ABSENT = object()  # an attribute the owner inherited rather than held


class Patch:
    """One change to another library (see the module docstring).

    Args:
      module: the library's module that must be imported before the change
        is made (the one whose attributes it changes, or one that imports
        them).
    """

    def __init__(self, module: str):
        self.module = module
        # Reentrant: applying may run while `install` holds it (module imported).
        self._lock = threading.RLock()
        self._changes: Callable[[], Iterable] | None = None  # set from install to undo
        # What the applied changes did: (Replaced, replacement, held before) or (Added, new items).
        self._applied: list[tuple] | None = None

    @property
    def installed(self) -> bool:
        """Whether the changes are made (not merely waiting for the import)."""
        return self._applied is not None

    def install(self, changes: Callable[[], Iterable]) -> None:
        """Makes the changes `changes()` lists, once: now if `self.module`
        is imported, else right after it is. `changes` (which may import the
        library's modules) is the first call's; later calls do nothing until
        `undo`. When the module is imported, the changes are made when this
        returns, on whatever thread asked first."""
        with self._lock:
            if self._changes is not None:
                return
            self._changes = changes
            when_imported(self.module, self._apply)

    def undo(self) -> bool:
        """Puts back what the changes replaced and takes out what they added,
        unless another library has replaced one of the attributes since (then
        nothing is undone). Returns whether the library is as it was."""
        with self._lock:
            applied = self._applied
            if applied is not None:
                if any(_held(change.owner, change.name) is not replacement
                       for change, replacement, _ in _replacements(applied)):
                    return False
                for record in reversed(applied):
                    _revert(*record)
            self._changes = self._applied = None
            return True

    def _apply(self) -> None:
        with self._lock:
            if self._changes is None or self._applied is not None:
                return  # undone while waiting for the import, or made already
            applied, complete = [], False
            try:
                for change in self._changes():
                    applied.append(_make(change))
                complete = True
            finally:
                if not complete:  # all or nothing: what was made is undone, and raised on
                    for record in reversed(applied):
                        _revert(*record)
                    self._changes = None
            self._applied = applied


def _held(owner, name: str):
    return vars(owner).get(name, _ABSENT)


def _make(change) -> tuple:
    if isinstance(change, Replaced):
        before = _held(change.owner, change.name)
        replacement = change.wrap(getattr(change.owner, change.name))
        setattr(change.owner, change.name, replacement)
        return change, replacement, before
    if isinstance(change, Registered):
        return change, change.register(change.hook)
    new = tuple(item for item in change.items if item not in change.collection)
    change.collection.update(new)
    return change, new


def _revert(change, *made) -> None:
    if isinstance(change, Replaced):
        _, before = made
        if before is _ABSENT:
            delattr(change.owner, change.name)
        else:
            setattr(change.owner, change.name, before)
    elif isinstance(change, Registered):
        made[0].remove()
    else:
        change.collection.difference_update(made[0])


def _replacements(applied: list) -> list[tuple]:
    return [record for record in applied if isinstance(record[0], Replaced)]
