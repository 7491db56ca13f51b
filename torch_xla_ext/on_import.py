"""Changing another library once it is imported, without importing it: how
`stack_layers` teaches peft and transformers' Trainer utilities about stacked
layers without making a user who does not use them pay for their import
(seconds each)."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import Callable

_lock = threading.Lock()
# (module name, teach) of each call waiting for its module to be imported.
_waiting: set[tuple[str, Callable[[], None]]] = set()


def when_imported(name: str, teach: Callable[[], None]) -> None:
    """Calls `teach()` now if module `name` is imported, else once right after
    it is executed, if it ever is (nothing is imported to look: a submodule's
    package may not be installed, or take seconds). Asked again for the same
    `name` and `teach` while it waits, it still calls `teach` once."""
    with _lock:
        if name not in sys.modules:
            if (name, teach) not in _waiting:
                _waiting.add((name, teach))
                sys.meta_path.insert(0, _TeachingOnImport(name, teach))
            return
    teach()


class _TeachingOnImport(importlib.abc.MetaPathFinder):
    """Finds module `name` as the other finders do, and calls `teach` once it
    is executed."""

    def __init__(self, name: str, teach: Callable[[], None]):
        self.name = name
        self.teach = teach

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        with _lock:
            sys.meta_path.remove(self)  # once; and the search below must not find this finder
            _waiting.discard((self.name, self.teach))
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            execute = spec.loader.exec_module

            def execute_and_teach(module):
                execute(module)
                self.teach()
            spec.loader.exec_module = execute_and_teach
        return spec
