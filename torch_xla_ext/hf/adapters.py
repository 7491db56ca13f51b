"""peft's whole-model operations on models whose layers stack_layers stacked.

peft finds the modules it adapts, saves and merges by walking the model's
modules (`named_modules()`), where a stacked list's layers are, as
themselves: saving an adapter, reading its status and picking its state
dict entries need nothing of ours, nor does switching adapters on and off
(`disable_adapter()`, `enable_adapter_layers`, `set_adapter`): peft sets
the layers' own modules, whose settings the stacks read again at the next
call (`layer_stack.addressed`). Adding or loading an adapter and
merging, dropping or deleting adapters change the layers' structure, which
the stacks must follow; so the first `stack_layers` call in a process where
peft is installed wraps them, for a model that holds a stack (any other
model is left to peft's own code): at once if peft is imported, else when
it is (importing peft takes seconds, which a user who does not use it
should not pay). They unstack the layers (each gets its tensors back), let
peft do its work on them, and stack them again with the same options, so
`get_peft_model(stack_layers(model))` and `stack_layers(get_peft_model(model))`
give the same model, with the same Parameter objects.

This module (what each operation runs inside) and `torch_xla_ext.patches.peft`
(which of peft's methods are wrapped, on which model) are the only places
that know about peft; the rest of torch_xla_ext treats its modules as any
other (peft's `kwargs['target_name']` is a setting that only names its
module, see `layer_stack.alike`).
"""
from __future__ import annotations

import contextlib
import functools

from torch import nn

from torch_xla_ext.layer_stack import StackedList
from torch_xla_ext.patches.peft import wrap_model_operations


def teach_peft(stack_layers, unstack) -> None:
    """Wraps peft's whole-model operations (above), once per process, if peft
    is installed: now if it is imported, else as soon as it is, through
    `torch_xla_ext.patches.peft` (`unstack_layers` undoes it). The wrappers
    convert with `stack_layers` and `unstack` (`unstack(model, path)`
    replaces one stack by its layers, without undoing the patch)."""
    wrap_model_operations(unstacked=functools.partial(_unstacked, stack_layers, unstack))


@contextlib.contextmanager
def _unstacked(stack_layers, unstack, model: nn.Module):
    """Unstacks the model's stacks for the block (which may replace modules in
    the layers: peft's adapters), then stacks the layers again, at the same
    paths and with the same options, whatever the block did or raised."""
    stacks = [(path, module.stack_options()) for path, module in model.named_modules()
              if isinstance(module, StackedList)]
    for path, _ in stacks:
        unstack(model, path)
    try:
        yield
    finally:
        for path, options in stacks:
            stack_layers(model, path, **options)
