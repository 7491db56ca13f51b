"""The change torch_xla_ext makes to peft: its whole-model operations run
inside contexts given by `torch_xla_ext.hf.adapters` (`wrap_model_operations`),
installed by the first `stack_layers` (now if peft is imported, else when it
is: importing it takes seconds) and undone by the `unstack_layers` after
which no stacked model remains (`undo`).

Which operations, on which model:

* `unstacked(model)`: adding or loading an adapter (`BaseTuner.inject_adapter`
  on its `model` argument, `PeftModel.load_adapter`), merging, dropping or
  deleting adapters (`BaseTuner.merge_and_unload`, `unload`,
  `delete_adapter`, on the tuner's model).

Switching adapters on and off and choosing the active ones need nothing:
peft sets the layers' own modules, which stay in the module tree, and the
stacks read their settings again (`layer_stack.addressed`).
"""
from __future__ import annotations

import functools
from typing import Callable, ContextManager

from torch_xla_ext.patches.patching import Patch, Replaced

__all__ = ["undo", "wrap_model_operations"]

_PEFT = Patch("peft")
_UNSTACKED_TUNER = ("merge_and_unload", "unload", "delete_adapter")

Context = Callable[[object], ContextManager]


def wrap_model_operations(unstacked: Context) -> None:
    """Runs peft's operations listed above inside `unstacked(model)`."""
    def changes():
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTuner

        return [
            Replaced(BaseTuner, "inject_adapter",
                     _inside(unstacked, lambda tuner, model, *_, **__: model)),
            *(Replaced(BaseTuner, name, _inside(unstacked, _tuner_model))
              for name in _UNSTACKED_TUNER),
            Replaced(PeftModel, "load_adapter",
                     _inside(unstacked, lambda peft_model, *_, **__: peft_model)),
        ]
    _PEFT.install(changes)


def _tuner_model(tuner, *_, **__):
    return tuner.model


def _inside(context: Context, model_of: Callable) -> Callable:
    """A wrapper of a method that runs it inside `context(model_of(*its arguments))`."""
    def wrap(method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            with context(model_of(*args, **kwargs)):
                return method(*args, **kwargs)
        return wrapper
    return wrap


def undo() -> bool:
    """Puts peft's methods back (see `patching.Patch.undo`)."""
    return _PEFT.undo()
