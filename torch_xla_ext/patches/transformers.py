"""The change torch_xla_ext makes to transformers: its class lookup for FSDP
wrapping (`search_class_lookup`), installed by the first `stack_layers` (now
if transformers' Trainer utilities are imported, else when they are: they
take seconds) and undone by the `unstack_layers` after which no stacked
model remains (`undo`)."""
from __future__ import annotations

import functools
from typing import Callable

from torch_xla_ext.patches.patching import Patch, Replaced

__all__ = ["search_class_lookup", "undo"]

_CLASS_LOOKUP = Patch("transformers.trainer_pt_utils")


def search_class_lookup(inside: Callable) -> None:
    """transformers' `get_module_class_from_name(module, name)` (how its FSDP
    wrapping finds `transformer_layer_cls_to_wrap`) first searches
    `inside(module)` when that is not None (a module it does not walk to),
    then `module` as before. It recurses through the module's global, so each
    submodule it visits passes here."""
    def changes():
        import transformers.trainer_pt_utils as trainer_utils

        def wrap(lookup):
            @functools.wraps(lookup)
            def get_module_class_from_name(module, name):
                hidden = inside(module)
                if hidden is not None:
                    found = lookup(hidden, name)
                    if found is not None:
                        return found
                return lookup(module, name)
            return get_module_class_from_name
        return [Replaced(trainer_utils, "get_module_class_from_name", wrap)]
    _CLASS_LOOKUP.install(changes)


def undo() -> bool:
    """Puts transformers' lookup back (see `patching.Patch.undo`)."""
    return _CLASS_LOOKUP.undo()
