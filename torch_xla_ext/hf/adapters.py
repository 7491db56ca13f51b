"""peft's whole-model operations on a PeftModel whose layers stack_layers stacked.

peft finds the modules it adapted by walking the model's modules for its tuner
layers (`named_modules()`): in `save_pretrained` (which adapter tensors to
save) and in `merge_and_unload`/`unload` (which modules to merge and replace).
A stack keeps the layers' modules in its template, out of that walk: peft
would save an empty adapter and leave the adapters in the merged model. So
`stack_layers` gives a PeftModel these three methods, which let peft's own
code see the layers as modules of the model:

* `save_pretrained` runs with the layers as modules whose tensors are views
  of the stacked ones (no copies; the stack is back afterwards, so training
  goes on with the same parameters and optimizer);
* `merge_and_unload` and `unload` unstack the layers (a copy of their
  tensors), let peft merge or drop the adapters, and stack the layers of the
  model they return, with the same options.

This is the one place that knows about peft; the rest of torch_xla_ext treats
its modules as any other (peft's `kwargs['target_name']` is a setting that
only names its module, see `layer_stack.alike`).
"""
from __future__ import annotations

import functools
import sys

from torch import nn


def reach_stacked_adapters(model: nn.Module) -> None:
    """Gives `model`, if it is a PeftModel, the methods above, by making it an
    instance of a subclass of its class (of the same name)."""
    peft = sys.modules.get("peft")  # a model can only be a PeftModel once peft is imported
    if (peft is not None and isinstance(model, peft.PeftModel)
            and not getattr(type(model), "_reaches_stacked_adapters", False)):
        model.__class__ = _reaching_stacked_adapters(type(model))


@functools.cache
def _reaching_stacked_adapters(peft_model_class: type) -> type:
    from torch_xla_ext.hf import layers_as_modules, stack_layers, unstack_layers
    from torch_xla_ext.hf.stacks import StackedLayers

    def save_pretrained(self, *args, **kwargs):
        with layers_as_modules(self):
            return peft_model_class.save_pretrained(self, *args, **kwargs)

    def unloaded(self, method: str, args, kwargs) -> nn.Module:
        stacks = [module for module in self.modules() if isinstance(module, StackedLayers)]
        if not stacks:  # unstacked already
            return getattr(self.base_model, method)(*args, **kwargs)
        options = dict(partition_fn=stacks[0].partition_fn, is_layer_pure=stacks[0].is_layer_pure,
                       per_layer_attributes=stacks[0].per_layer_attributes)
        model = getattr(unstack_layers(self).base_model, method)(*args, **kwargs)
        return stack_layers(model, **options)

    def merge_and_unload(self, *args, **kwargs):
        return unloaded(self, "merge_and_unload", args, kwargs)

    def unload(self, *args, **kwargs):
        return unloaded(self, "unload", args, kwargs)

    return type(peft_model_class.__name__, (peft_model_class,), {
        "__module__": peft_model_class.__module__,
        "__qualname__": peft_model_class.__qualname__,
        "__doc__": peft_model_class.__doc__,
        "_reaches_stacked_adapters": True,
        "save_pretrained": save_pretrained,
        "merge_and_unload": merge_and_unload,
        "unload": unload,
    })
