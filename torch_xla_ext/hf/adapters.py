"""peft's whole-model operations on models whose layers stack_layers stacked.

peft finds the modules it adapts, saves and merges by walking the model's
modules (`named_modules()`): when it adds an adapter (`get_peft_model`,
`PeftModel.from_pretrained`, `add_adapter`), when it saves or loads one (which
adapter tensors there are), and when it merges or drops them
(`merge_and_unload`, `unload`). A stack keeps the layers' modules in its
template, out of that walk: peft would refuse the stacked tensors as targets,
save an empty adapter and leave the adapters in a merged model. So the first
`stack_layers` call in a process where peft is installed teaches peft's
classes to see the layers as modules, for a model that holds a stack (any
other model is left to peft's own code): at once if peft is imported, else
when it is (importing peft takes seconds, which a user who does not use it
should not pay):

* adding or loading an adapter and merging or dropping the adapters unstack
  the layers (a copy of their tensors), let peft do its work on them, and
  stack them again with the same options: `get_peft_model(stack_layers(model))`
  and `stack_layers(get_peft_model(model))` give the same model (loading may
  add modules to the layers, which views of them would lose);
* saving an adapter, and reading the adapters' status (`get_model_status`,
  `get_layer_status`), run with the layers as modules whose tensors are views
  of the stacked ones (no copies; the stack is back afterwards, so training
  goes on with the same parameters and optimizer);
* switching adapters on and off (`disable_adapter()`, `enable_adapter_layers`)
  and choosing the active ones (`set_adapter`, `set_requires_grad`) run with
  each stack's template layer (whose settings every layer's step runs) among
  the model's modules; then each stacked tensor takes its template tensor's
  `requires_grad`, as peft set it. The stacked parameters stay the same
  objects, so an optimizer made before keeps them;
* deleting an adapter unstacks the layers, as adding one does.

This module (what each operation runs inside) and `torch_xla_ext.patches.peft`
(which of peft's methods are wrapped, on which model) are the only places
that know about peft; the rest of torch_xla_ext treats its modules as any other (peft's `kwargs['target_name']` is a setting that
only names its module, see `layer_stack.alike`).
"""
from __future__ import annotations

import contextlib
import functools

from torch import nn

from torch_xla_ext.layer_stack import LayerStack, StackedList
from torch_xla_ext.patches.peft import wrap_model_operations


def teach_peft(stack_layers, unstack) -> None:
    """Wraps peft's whole-model operations (above), once per process, if peft
    is installed: now if it is imported, else as soon as it is, through
    `torch_xla_ext.patches.peft` (`unstack_layers` undoes it). The wrappers
    convert with `stack_layers` and `unstack` (`unstack(model, path)`
    replaces one stack by its layers, without undoing the patch)."""
    wrap_model_operations(unstacked=functools.partial(_unstacked, stack_layers, unstack),
                          layers_as_modules=_layers_as_modules,
                          templates_as_modules=_templates_as_modules)


@contextlib.contextmanager
def _templates_as_modules(model: nn.Module):
    """While the block runs, each stack's template layer is a submodule of
    the stack (`<stack>.template`), for peft to change its settings; after
    it, each stacked tensor takes the `requires_grad` of its template tensor."""
    stacks = [module for module in model.modules()
              if isinstance(module, LayerStack) and module.template is not None]
    for stack in stacks:
        stack._modules["template"] = stack.template
    try:
        yield
    finally:
        for stack in stacks:
            del stack._modules["template"]
            in_template = dict(stack.template.named_parameters())
            for name, param in stack.stacked.named_parameters():
                param.requires_grad_(in_template[name].requires_grad)


@contextlib.contextmanager
def _layers_as_modules(model: nn.Module):
    """While the block runs, each stacked list of the model is an
    `nn.ModuleList` of its layers as modules, whose tensors are views of the
    stacked ones (no copies): for peft reading each layer as a module."""
    stacks = [(model.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2], module)
              for path, module in model.named_modules() if isinstance(module, StackedList)]
    for parent, name, stack in stacks:
        setattr(parent, name, nn.ModuleList([stack.layer(index) for index in range(len(stack))]))
    try:
        yield
    finally:
        for parent, name, stack in stacks:
            setattr(parent, name, stack)


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
