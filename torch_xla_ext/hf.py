"""Hugging Face transformers models whose decoder layers run as one `scan`,
under the model's own, unmodified `forward`.

`stack_layers(model)` replaces the decoder-layer `nn.ModuleList` of a
transformers model (`model.model.layers` of Llama, Mistral, Qwen2, ...) by a
`StackedLayers`: a `LayerStack` that holds every weight once, stacked along a
leading layer dimension. The model's forward loops
`for decoder_layer in self.layers[: self.config.num_hidden_layers]`; a slice
of all the layers of a `StackedLayers` is a list of one callable, the stack
itself, which runs every layer as one scan. Everything else about the model
stays as it was: its forward, its config, the rest of its modules, and the
per-layer names of its `state_dict()`.
"""
from __future__ import annotations

import inspect
import re
from typing import Iterable

from torch import nn

from torch_xla_ext.layer_stack import LayerStack
from torch_xla_ext.layer_stack.running import run_layer_by_layer

__all__ = ["StackedLayers", "stack_layers"]

# Output flags of transformers models that collect something from every layer
# (`output_hidden_states`, `output_attentions`, ...); a scan has no per-layer outputs.
_PER_LAYER_OUTPUTS = ("hidden_states", "attentions")

# transformers' own output-capturing hooks are inactive unless an output is
# requested, and a StackedLayers refuses such requests itself.
_TRANSFORMERS_CAPTURE_HOOKS = "transformers.utils.output_capturing"

_CACHE_REASON = (
    "a key/value cache is in play (use_cache=True, the default of most transformers configs, "
    "or past_key_values), and each layer updates its own slot of it; to train with one scan, "
    "pass use_cache=False (or set model.config.use_cache = False)")


class StackedLayers(LayerStack):
    """The decoder layers of a transformers model, stacked (see `stack_layers`).

    A `LayerStack` with what a transformers model's forward needs:

    * `layers[a:b]` covering all the layers is `[layers]`: the model's loop calls
      the stack once, which runs every layer as one scan (layer by layer when a
      key/value cache is passed). Any other slice is the list of those layers;
      `layers[i]` and iteration give per-layer modules whose tensors are views of
      the stacked ones.
    * The template layer reads the model's own config object, so changing it
      (`model.config._attn_implementation = "eager"`, say) reaches the layers as
      it would reach the original ones.
    * Calls that ask for each layer's output (`output_hidden_states`,
      `output_attentions`, in the call or in the config) raise: one scan has no
      per-layer outputs.
    """

    def __init__(self, layers: Iterable[nn.Module], config=None,
                 recorded_outputs: Iterable[str] = _PER_LAYER_OUTPUTS, **options):
        layers = list(layers)
        super().__init__(layers, **options)
        self.model_config = config
        self.recorded_outputs = tuple(recorded_outputs)
        if config is not None and self._template is not None:
            _share_config(self._template, layers[0], config)

    def __getitem__(self, index):
        if isinstance(index, slice) and range(len(self))[index] == range(len(self)):
            return [self]
        return super().__getitem__(index)

    def forward(self, hidden_states, *args, **kwargs):
        requested = [name for name in self.recorded_outputs
                     if self._output_requested(f"output_{name}", kwargs)]
        if requested:
            flags = ", ".join(f"output_{name}" for name in requested)
            raise ValueError(
                f"stack_layers: the call asks for every decoder layer's output ({flags}), "
                f"but the stacked layers run as one scan, which has none. Call the model without "
                f"{flags} (and set it to False in model.config), or use a model that "
                f"stack_layers did not convert for this call.")
        if kwargs.get("past_key_values") is not None:
            # What LayerStack does with a cache too, with advice for transformers users.
            return run_layer_by_layer(self.__getitem__, len(self), hidden_states, args, kwargs,
                                       drop_in=False, reason=_CACHE_REASON)
        return super().forward(hidden_states, *args, **kwargs)

    def _output_requested(self, flag: str, kwargs: dict) -> bool:
        # As transformers decides: the call's flag, else the config's.
        return bool(kwargs[flag] if flag in kwargs else getattr(self.model_config, flag, False))


def _share_config(template: nn.Module, layer: nn.Module, config) -> None:
    """Points the template's references to `config` back at `config` itself,
    which the template's deep copy had copied."""
    originals = dict(layer.named_modules())
    for path, module in template.named_modules():
        for attribute, value in vars(originals[path]).items():
            if value is config:
                setattr(module, attribute, config)


def stack_layers(model: nn.Module, path: str | None = None, **options) -> nn.Module:
    """Stacks the decoder layers of a transformers model in place; returns `model`.

    After it, the model's own `forward` runs all decoder layers as one `scan`
    (one trace, one XLA While loop forward and backward) whenever no key/value
    cache is in play, as in training with `use_cache=False`; its weights are
    held once, stacked (`model.model.layers.stacked.self_attn.q_proj.weight`
    is `[num_layers, out, in]`), and receive the gradients. With a key/value
    cache (`use_cache=True`, which is most configs' default, or
    `past_key_values`; `model.generate(...)`) the layers run one by one, each
    with its own cache slot, and give the same results as before the
    conversion; a `LayerByLayerWarning` says so (once per process, as Python
    shows a warning), with the advice to train with `use_cache=False`.

    What stays as it was: the model's forward and config, every other module,
    `state_dict()` keys and values (`model.layers.3.self_attn.q_proj.weight`),
    so `save_pretrained()` writes an ordinary checkpoint and
    `load_state_dict()` of one works; `model.model.layers[i]` (a module whose
    tensors are views of slice i of the stacked ones) and `len()`.
    `named_parameters()` names the stacked tensors
    (`model.layers.stacked.mlp.up_proj.weight`), which can be sharded with
    `mark_sharding` along any dimension but the first.

    Not supported, and refused with an error that says so: layers that are not
    all alike (a sliding window on some layers only, a setting changed on one
    layer: the scan runs layer 0's code with each layer's weights), layers
    with hooks or gradient checkpointing enabled (neither would run inside the
    scan), a forward that does not loop over `self.layers[...]`, and calls with
    `output_hidden_states` or `output_attentions`. Gradient checkpointing
    enabled after the conversion does not reach the layers; the scan's
    partitioner decides what its backward recomputes. Without a cache, a
    converted model runs on XLA devices only (the scan is an XLA loop).

    Args:
      model: a transformers model (`LlamaForCausalLM`, `MistralForCausalLM`,
        `Qwen2ForCausalLM`, their base models, ...), on any device.
      path: the attribute path of the decoder-layer `nn.ModuleList`, such as
        "model.layers"; by default the one `nn.ModuleList` of the model whose
        layers are all of a class the model names in `_no_split_modules`.
      options: passed to `LayerStack`: `partition_fn` (what the forward loop
        keeps for the backward: a policy of `torch_xla_ext.policies` or its
        name, `"save_nothing"` to recompute each layer in the backward),
        `is_layer_pure`, `per_layer_attributes` (default `("layer_idx",)`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"stack_layers: model must be an nn.Module, got {type(model).__name__}")
    path = _layers_path(model) if path is None else path
    layers = _submodule(model, path)
    if isinstance(layers, StackedLayers):
        return model  # converted already
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"stack_layers: {path!r} is a {type(layers).__name__}, not the "
                        f"nn.ModuleList of decoder layers; pass the path of that list.")
    parent_path, _, name = path.rpartition(".")
    owner = model.get_submodule(parent_path)
    _check_forward_slices(owner, name, path)
    config = getattr(owner, "config", getattr(model, "config", None))
    _check_layer_types(config, len(layers))
    for index, layer in enumerate(layers):
        _check_no_hooks_or_checkpointing(layer, f"{path}.{index}")
    try:
        stack = StackedLayers(layers, config, _recorded_outputs(owner), **options)
    except (TypeError, ValueError) as error:
        raise type(error)(f"stack_layers: cannot stack the layers at {path!r}: {error}") from error
    setattr(owner, name, stack)
    return model


def _submodule(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"stack_layers: {type(model).__name__} has no submodule {path!r}; "
                         f"pass path as the dotted name of its decoder-layer nn.ModuleList, "
                         f"such as 'model.layers'.") from None


def _layers_path(model: nn.Module) -> str:
    """The path of the model's one nn.ModuleList of decoder layers."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    found = [name for name, module in model.named_modules()
             if isinstance(module, (nn.ModuleList, StackedLayers)) and len(module)
             and _one_class_among(module, layer_classes)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValueError(
            f"stack_layers: found no decoder-layer nn.ModuleList in {type(model).__name__} "
            f"(none holds layers of the classes it names in _no_split_modules: "
            f"{sorted(layer_classes)}); pass path='...' naming it.")
    raise ValueError(f"stack_layers: {type(model).__name__} has several lists of decoder "
                     f"layers: {found}; pass path='...' naming the one to stack.")


def _one_class_among(layers: nn.Module, class_names: set) -> bool:
    if isinstance(layers, StackedLayers):
        return type(layers._template).__name__ in class_names
    classes = {type(layer) for layer in layers}
    return len(classes) == 1 and next(iter(classes)).__name__ in class_names


def _check_forward_slices(owner: nn.Module, name: str, path: str) -> None:
    """The owner's forward must take the layers as a slice (`self.layers[: n]`),
    which is what yields the one callable that runs the scan."""
    forward = type(owner).forward
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        source = ""
    if not re.search(rf"self\.{re.escape(name)}\s*\[", source):
        raise ValueError(
            f"stack_layers: {type(owner).__qualname__}.forward does not loop over a slice "
            f"`self.{name}[...]` (or its source is not available), so it would call the "
            f"layers at {path!r} one by one, not as one scan. stack_layers takes over "
            f"loops of the form `for layer in self.{name}[: n]`; for other models, call a "
            f"torch_xla_ext.LayerStack from your own forward.")


def _check_layer_types(config, count: int) -> None:
    """transformers configs list per-layer kinds (full or sliding attention) in
    `layer_types`; the forward then passes each layer the mask of its kind."""
    layer_types = list(getattr(config, "layer_types", None) or ())[:count]
    for index, layer_type in enumerate(layer_types):
        if layer_type != layer_types[0]:
            raise ValueError(
                f"stack_layers: layer {index} differs from layer 0: config.layer_types[{index}] "
                f"is {layer_type!r} but config.layer_types[0] is {layer_types[0]!r}. The scan "
                f"runs one computation for every layer, so stack_layers converts only models "
                f"whose layers are all alike; the model is unchanged.")


def _check_no_hooks_or_checkpointing(layer: nn.Module, path: str) -> None:
    for module_path, module in layer.named_modules():
        where = f"{path}.{module_path}" if module_path else path
        for registry in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                         "_backward_hooks"):
            for hook in getattr(module, registry).values():
                if getattr(hook, "__module__", None) == _TRANSFORMERS_CAPTURE_HOOKS:
                    continue
                raise ValueError(
                    f"stack_layers: {where} has a hook in {registry} "
                    f"({getattr(hook, '__qualname__', hook)!r}); the stacked layers run inside "
                    f"one scan, where hooks of the layers would not run. Remove it first; the "
                    f"model is unchanged.")
        if getattr(module, "gradient_checkpointing", False) is True:
            raise ValueError(
                f"stack_layers: {where} has gradient checkpointing enabled; "
                f"torch.utils.checkpoint cannot run inside the scan (whose partitioner decides "
                f"what the backward recomputes). Disable it first "
                f"(model.activation_checkpointing_disable(), gradient_checkpointing_disable() "
                f"before transformers 5); the model is unchanged.")


def _recorded_outputs(owner: nn.Module) -> tuple[str, ...]:
    """What the model can collect from every layer: transformers' `_can_record_outputs`
    keys, and the hidden states and attentions any model may collect itself."""
    recordable = getattr(owner, "_can_record_outputs", None) or {}
    return tuple(dict.fromkeys((*_PER_LAYER_OUTPUTS, *recordable)))
