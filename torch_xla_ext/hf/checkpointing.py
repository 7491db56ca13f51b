"""transformers' gradient checkpointing on stacked layers: the scan's policy.

transformers enables it (`activation_checkpointing_enable()`, or its alias
`gradient_checkpointing_enable()`, which `Trainer` calls for
`TrainingArguments(gradient_checkpointing=True)`) by setting
`gradient_checkpointing = True` and `_gradient_checkpointing_func` (its
checkpoint function, `functools.partial(torch.utils.checkpoint.checkpoint,
**kwargs)`) on each of the model's modules that has a `gradient_checkpointing`
attribute: the decoder layers (`GradientCheckpointingLayer`, whose forward
then runs under that function while training) and the base model. A stack
has the attribute too, so enabling after `stack_layers` sets it on the stack;
enabling before sets it on the layers, and the stack takes it from them
(`taken_from`), clearing it on the template layer, so that no checkpoint
function runs inside the scan. Each call of the stack then reads it
(`under_policy`): while training with it set, the scan runs under
`save_nothing`, which recomputes each layer in the backward loop, as the
checkpoint function would; otherwise under the stack's own `partition_fn`,
so disabling restores it. A layer that runs by itself (one the
call plan runs as itself or one by one) keeps transformers' checkpointing, with
torch_xla's checkpoint function on XLA (`runnable_on`).

`every_n_layers` sets the flag on some GradientCheckpointingLayers only:
`stack_layers` refuses such layers, as one scan recomputes every layer or
none; after the conversion the layers are no modules of the model, so
transformers sets the flag on the stack alone and every layer recomputes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings

import torch
import torch.utils.checkpoint
import torch_xla.utils.checkpoint
from torch import nn

from torch_xla_ext.layer_stack import Layers
from torch_xla_ext.policies import save_nothing
from torch_xla_ext.diagnostics import TorchXlaExtWarning

# Checkpoint functions that recompute what they wrap and do nothing else.
_RECOMPUTING = (torch.utils.checkpoint.checkpoint, torch_xla.utils.checkpoint.checkpoint)

# Keywords of torch's checkpoint that ask for nothing the scan's recomputation
# does not do, with the values that do so (None: any value). use_reentrant
# picks torch's implementation; random ops are never redrawn in the backward
# loop (preserve_rng_state=True asks that, False allows it); the backward
# step recomputes the traced program itself (determinism_check), whole
# (early_stop only saves time).
_WITHOUT_EFFECT = {"use_reentrant": None, "preserve_rng_state": None,
                   "determinism_check": None, "early_stop": None, "debug": (False,),
                   "context_fn": (torch.utils.checkpoint.noop_context_fn,)}


class CheckpointingWarning(TorchXlaExtWarning):
    """Part of what gradient checkpointing was enabled with does not happen
    on the stacked layers; the message says what, and what happens instead."""


def taken_from(templates: list[nn.Module]) -> tuple[bool, object]:
    """The gradient checkpointing set on the layers that `templates` (the
    stack's copies of them) were made from: whether it is enabled, and its
    checkpoint function. Clears both on the templates, whose forward runs
    inside the scan (and whose settings are part of what a trace is kept by)."""
    enabled, function = False, None
    for template in templates:
        for module in template.modules():
            if getattr(module, "gradient_checkpointing", False) is True:
                enabled, function = True, getattr(module, "_gradient_checkpointing_func", None)
                module.gradient_checkpointing = False
            if getattr(type(module), "gradient_checkpointing", None) is False:
                module.__dict__.pop("gradient_checkpointing", None)  # the class's own again
            module.__dict__.pop("_gradient_checkpointing_func", None)
    return enabled, function


def given_to(layers: list[nn.Module], stack: nn.Module) -> list[nn.Module]:
    """`layers` (a stack's, unstacked) with the stack's gradient checkpointing
    set as transformers sets it; returns them."""
    if stack.gradient_checkpointing:
        for layer in layers:
            for module in layer.modules():
                if hasattr(module, "gradient_checkpointing"):
                    module._gradient_checkpointing_func = stack._gradient_checkpointing_func
                    module.gradient_checkpointing = True
    return layers


@contextlib.contextmanager
def runnable_on(layer: nn.Module, device: torch.device):
    """While `layer` runs by itself on `device`, outside any scan (the plan
    runs it as a single layer, or one by one): on XLA, transformers' checkpoint function
    (torch's, which fails on XLA tensors) is torch_xla's, with the same
    keywords, so that the layer recomputes in the backward as the scan after
    it does; elsewhere, and for any other function, as it is. torch_xla's
    has the reentrant implementation only: `use_reentrant` only picks one
    (see `_WITHOUT_EFFECT`)."""
    swapped = []
    if device.type == "xla":
        for module in layer.modules():
            function = getattr(module, "_gradient_checkpointing_func", None)
            if (getattr(module, "gradient_checkpointing", False) is True
                    and isinstance(function, functools.partial)
                    and function.func is torch.utils.checkpoint.checkpoint):
                swapped.append((module, function))
                module._gradient_checkpointing_func = functools.partial(
                    torch_xla.utils.checkpoint.checkpoint, *function.args,
                    **{**function.keywords, "use_reentrant": True})
    try:
        yield
    finally:
        for module, function in swapped:
            module._gradient_checkpointing_func = function


def under_policy(stack: nn.Module, layers: Layers) -> Layers:
    """`layers` (the stack's, or a segment's, as the runners take them) under
    the policy of a call of `stack` training with gradient checkpointing
    enabled: `save_nothing`."""
    _warn_unhonoured(stack._gradient_checkpointing_func)
    return dataclasses.replace(layers, partition_fn=save_nothing)


def _warn_unhonoured(function) -> None:
    """Warns about what the checkpoint function asks beyond recomputing each
    layer, which does not happen."""
    keywords = dict(function.keywords) if isinstance(function, functools.partial) else {}
    base = function.func if isinstance(function, functools.partial) else function
    if function is not None and base not in _RECOMPUTING:
        warnings.warn(
            f"gradient checkpointing: the stacked layers run as one scan, which cannot call "
            f"the checkpoint function {getattr(base, '__qualname__', base)!r}; the scan "
            f"recomputes each layer in its backward loop (policy save_nothing) instead, and "
            f"whatever else that function does (activation_checkpointing_enable(offload=True) "
            f"keeps the saved inputs in host memory) does not happen.",
            CheckpointingWarning, stacklevel=4)
    unhonoured = {name: value for name, value in keywords.items()
                  if name not in _WITHOUT_EFFECT
                  or (_WITHOUT_EFFECT[name] is not None and value not in _WITHOUT_EFFECT[name])}
    if unhonoured:
        warnings.warn(
            f"gradient checkpointing: the stacked layers run as one scan that recomputes "
            f"each layer in its backward loop (policy save_nothing), which cannot honour "
            f"{', '.join(f'{name}={value!r}' for name, value in unhonoured.items())} among "
            f"gradient_checkpointing_kwargs; they have no effect. For another policy, pass "
            f"partition_fn to stack_layers and do not enable gradient checkpointing.",
            CheckpointingWarning, stacklevel=4)
