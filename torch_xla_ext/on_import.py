"""Changing another library once it is imported, without importing it: how
`stack_layers` teaches peft and transformers' Trainer utilities about stacked
layers without making a user who does not use them pay for their import
(seconds each)."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable

# The modules when_imported was asked about, each handled once per process.
_handled: set[str] = set()


def when_imported(name: str, teach: Callable[[], None]) -> None:
    """Calls `teach()` once per process: now if module `name` is imported,
    else right after it is executed, if it ever is (nothing is imported to
    look: a submodule's package may not be installed, or take seconds)."""
    if name in _handled:
        return
    _handled.add(name)
    if name in sys.modules:
        teach()
    else:
        sys.meta_path.insert(0, _TeachingOnImport(name, teach))


class _TeachingOnImport(importlib.abc.MetaPathFinder):
    """Finds module `name` as the other finders do, and calls `teach` once it
    is executed."""

    def __init__(self, name: str, teach: Callable[[], None]):
        self.name = name
        self.teach = teach

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # once; and the search below must not find this finder
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            execute = spec.loader.exec_module

            def execute_and_teach(module):
                execute(module)
                self.teach()
            spec.loader.exec_module = execute_and_teach
        return spec
