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

This is the one place that knows about peft; the rest of torch_xla_ext treats
its modules as any other (peft's `kwargs['target_name']` is a setting that
only names its module, see `layer_stack.alike`).
"""
from __future__ import annotations

import contextlib
import functools

from torch import nn

from torch_xla_ext.on_import import when_imported
from torch_xla_ext.layer_stack import LayerStack, StackedList


# stack_layers and unstack_layers, given by the first call of teach_peft.
_CONVERSION: list = []


def teach_peft(stack_layers, unstack_layers) -> None:
    """Wraps peft's whole-model operations (above), once per process, if peft
    is installed: now if it is imported, else as soon as it is. The wrappers
    convert with `stack_layers` and `unstack_layers`."""
    if not _CONVERSION:
        _CONVERSION[:] = [stack_layers, unstack_layers]
    when_imported("peft", _teach)


def _teach() -> None:
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    BaseTuner.inject_adapter = _on_unstacked_layers(BaseTuner.inject_adapter,
                                                    lambda tuner, model, *_, **__: model)
    for name in ("merge_and_unload", "unload", "delete_adapter"):
        setattr(BaseTuner, name, _on_unstacked_layers(getattr(BaseTuner, name),
                                                      lambda tuner, *_, **__: tuner.model))
    PeftModel.load_adapter = _on_unstacked_layers(PeftModel.load_adapter,
                                                  lambda peft_model, *_, **__: peft_model)
    for name in ("save_pretrained", "get_model_status", "get_layer_status"):
        setattr(PeftModel, name, _on_layer_modules(getattr(PeftModel, name)))
    for name in ("_enable_adapter_layers", "set_adapter", "set_requires_grad"):
        setattr(BaseTuner, name, _on_templates(getattr(BaseTuner, name)))


def _on_unstacked_layers(method, model_of):
    """`method`, run with the stacks of `model_of(*its arguments)` unstacked."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with _unstacked(model_of(*args, **kwargs)):
            return method(*args, **kwargs)
    return wrapper


def _on_layer_modules(method):
    """`method` of a PeftModel, run with its stacks' layers as modules."""
    @functools.wraps(method)
    def wrapper(peft_model, *args, **kwargs):
        with _layers_as_modules(peft_model):
            return method(peft_model, *args, **kwargs)
    return wrapper


def _on_templates(method):
    """`method` of a tuner, run with its model's template layers as modules."""
    @functools.wraps(method)
    def wrapper(tuner, *args, **kwargs):
        with _templates_as_modules(tuner.model):
            return method(tuner, *args, **kwargs)
    return wrapper


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
def _unstacked(model: nn.Module):
    """Unstacks the model's stacks for the block (which may replace modules in
    the layers: peft's adapters), then stacks the layers again, at the same
    paths and with the same options, whatever the block did or raised."""
    stack_layers, unstack_layers = _CONVERSION
    stacks = [(path, module.stack_options()) for path, module in model.named_modules()
              if isinstance(module, StackedList)]
    for path, _ in stacks:
        unstack_layers(model, path)
    try:
        yield
    finally:
        for path, options in stacks:
            stack_layers(model, path, **options)
