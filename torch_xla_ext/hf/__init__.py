"""Hugging Face transformers models whose decoder layers run as one `scan`,
under the model's own, unmodified `forward`.

`stack_layers(model)` replaces the decoder-layer `nn.ModuleList` of a
transformers model (`model.model.layers` of Llama, Mistral, Qwen2, ...; each
of a multimodal model's layer lists) by a `StackedLayers`: a `LayerStack`
that holds every weight once, stacked along a leading layer dimension. The
model's forward loops `for decoder_layer in self.layers[: self.config.num_hidden_layers]`; a slice
of all the layers of a `StackedLayers` is a list of one callable, the stack
itself, which runs every layer as one scan. A forward that iterates over the
layers (`for block in self.h`, GPT-2's) gets a callable per layer, the first
of which runs the scan and the others hand the hidden state on: forward
hooks on its module tell the stack that its forward runs (elsewhere,
iteration gives the layers as modules). Everything else about the model
stays as it was: its forward, its config, the rest of its modules, and the
per-layer names of its `state_dict()`.

The modules, one job each: `inspection` (reading the model: its layer list,
its forward's loop, its layer kinds, what a scan cannot run), `stacks` (the
stacks put in place of the layer list), `cache_plan` (how a call with a
key/value cache runs: the one description of it, and the decision),
`caches` (transformers' key/value caches around the scan), `adapters` (peft's whole-model operations on a
stacked PeftModel), `checkpointing` (transformers' gradient checkpointing as
the scan's policy), `fsdp` (transformers' FSDP class lookup finding stacked
layers).
"""
from __future__ import annotations

import warnings

from torch import nn

from torch_xla_ext.hf import adapters, fsdp
from torch_xla_ext.hf.discovery import (
    LayerList, Unstackable, UnstackedLayersWarning, layer_list, layer_list_paths,
    recorded_outputs, submodule)
from torch_xla_ext.hf.stacks import StackedLayers
from torch_xla_ext.layer_stack import OwnerPlans, drive_loops, loop_names, undrive_loops

__all__ = ["StackedLayers", "UnstackedLayersWarning", "stack_layers", "unstack_layers"]


def stack_layers(model: nn.Module, path: str | None = None, **options) -> nn.Module:
    """Stacks the decoder layers of a transformers model in place; returns `model`.

    After it, the model's own `forward` runs all decoder layers as one `scan`
    (one trace, one XLA While loop forward and backward); its weights are
    held once, stacked (`model.model.layers.stacked.self_attn.q_proj.weight`
    is `[num_layers, out, in]`), and receive the gradients. A call with a
    key/value cache (an empty or a decoding `DynamicCache`, a `StaticCache`)
    runs as one scan where the cache allows, else the layers one by one with
    the same results and a `LayerByLayerWarning` saying why (once per
    process, as Python shows a warning): see `torch_xla_ext.hf.cache_plan`.

    What stays as it was: the model's forward and config, every other module,
    `state_dict()` keys and values (`model.layers.3.self_attn.q_proj.weight`),
    so `save_pretrained()` writes an ordinary checkpoint and
    `load_state_dict()` of one works; an optimizer's `state_dict()` (made
    from the converted model's parameters: saved in the unconverted layout,
    and loading it, see `torch_xla_ext.layer_stack.optimizer_state`), so a
    Trainer checkpoint resumes on either side; `model.model.layers[i]` (a module whose
    tensors are views of slice i of the stacked ones) and `len()`.
    `named_parameters()` names the stacked tensors
    (`model.layers.stacked.mlp.up_proj.weight`), which can be sharded with
    `mark_sharding` along any dimension but the first; FSDPv2, as
    transformers' Trainer wraps a model (`wrap_model_xla_fsdp`, naming the
    layer class in `transformer_layer_cls_to_wrap`), shards each as it
    would one layer's weight, never along the layer dimension (see
    `torch_xla_ext.hf.fsdp`).

    Layers of several kinds (`config.layer_types` not all the same: Gemma2's
    alternating sliding and full attention, Gemma3's pattern, Qwen2's
    `max_window_layers`) that differ only in settings telling the kinds apart
    (`sliding_window`, `layer_type`) are one StackedLayers too, each layer
    keeping its own settings: the model's loop gets a callable per layer,
    the calls are recorded until each kind has been called once, and one
    scan gives each layer its kind's mask and rotary table (each enters the
    loop once; a step picks its layer's). The scan stands for every kind once
    each kind's layer is shown, by tracing it on fake tensors, to compute the
    same graph (transformers' eager and SDPA attention take `sliding_window`
    and drop it: the mask does the windowing); else the layers run one by
    one, with a `LayerByLayerWarning`, as they do when the kinds' arguments
    differ in more than tensors of one shape. Where SDPA's full-attention
    layers get no mask and the sliding ones a mask, the None becomes the
    causal mask it stands for. A layer given another argument than the first
    of its kind raises.

    Kinds whose layers differ in more than that (other submodules or shapes)
    become a `StackedLayerKinds`: the smallest repeating pattern of kinds
    runs as one scan over groups of one period of layers, and what does not
    fit whole periods (or a model whose kinds come in blocks) as one scan per
    run of one kind; a few scans in one step graph. Its `state_dict()`,
    `len()` and `layers[i]` are as above; `named_parameters()` names the
    stacked tensors per segment
    (`model.layers.segments.0.stacked.layers.1.mlp.up_proj.weight`:
    position 1 of each group). Its calls with a key/value cache are as
    `torch_xla_ext.hf.cache_plan` says.

    peft: `stack_layers(get_peft_model(model, config))` and
    `get_peft_model(stack_layers(model), config)` give the same model, whose
    LoRA adapters train as one scan (the base weights stay stacked and
    frozen); `save_pretrained`, `PeftModel.from_pretrained` (of a stacked
    base model too), `merge_and_unload` and `unload` work as unconverted
    (merge_and_unload returns the merged model stacked), and so do
    `disable_adapter()`, `set_adapter`, `load_adapter`, `delete_adapter` and
    the adapters' status. The first call teaches peft's classes to see
    stacked layers as modules, when peft is imported (see
    `torch_xla_ext.hf.adapters`); `unstack_layers(model)` undoes the
    conversion, for peft's other operations.

    A forward whose loop hands values each layer returns back as arguments
    of the next call (T5's `hidden_states, position_bias, ... =
    layer_module(hidden_states, mask, position_bias, ...)`, then
    `position_bias = ...`, perhaps under an `if` that calls nothing) becomes
    a `StackedAfterFirst`: layer 0, which gets what the forward set before
    the loop (None: it computes the position biases), runs as itself, and
    the other layers as one scan, those values entering it as arguments of
    every step, once a call of a layer on fake tensors shows that each
    layer returns them as it got them (else, and with a key/value cache
    that holds tokens, each call runs its layer, with a
    `LayerByLayerWarning`; an empty one the scan fills). The loop's later
    calls must get what the scan returned; a loop that hands on something
    else raises.

    Not supported, and refused with an error that says so: layers of one kind
    that are not alike (a setting changed on one layer: the scan runs the
    first layer's code with each layer's weights), layers of kinds that
    differ in more than their settings under a forward that iterates over
    them (`for block in self.h`), layers with hooks (they would not run
    inside the scan) or with gradient checkpointing enabled on some only
    (`every_n_layers`), a forward that neither loops
    over `self.layers[...]` nor iterates over `self.layers` calling each layer
    on the hidden state alone (after lookups such as Exaone4's `layer_type =
    self.config.layer_types[i]`, which call nothing; a statement under a
    test of the owner's settings, BART's LayerDrop, makes the layers run one by
    one, with a LayerByLayerWarning, while the test holds), and calls with
    `output_hidden_states` or `output_attentions` to a model that collects
    them in its own loop. Both stacks give them from their scans:
    `stack_layers` installs transformers' output-capturing hooks on the
    layers before stacking, and the stack replays them after the loop (see
    `StackedLayers`). Gradient checkpointing
    (transformers' `gradient_checkpointing_enable()`, before or after the
    conversion) makes the scan recompute each layer while training (policy
    `save_nothing`, see `torch_xla_ext.hf.checkpointing`);
    `gradient_checkpointing_disable()` brings back `partition_fn`. On a device other
    than XLA (a model moved to the CPU), the layers run one by one, with a
    `LayerByLayerWarning`: the scan is an XLA loop.

    Args:
      model: a transformers model (`LlamaForCausalLM`, `MistralForCausalLM`,
        `Qwen2ForCausalLM`, their base models, ...), on any device.
      path: the attribute path of the decoder-layer `nn.ModuleList` to stack,
        such as "model.layers"; an error says why if it cannot be stacked. By
        default every `nn.ModuleList` of the model whose layers are all of a
        class the model names in `_no_split_modules` (a multimodal model's
        vision encoder layers and language model layers, each its own scan);
        one that cannot be stacked (its forward's loop, hooks, checkpointing
        on some layers, layers of one kind not alike) stays as it was, with an
        `UnstackedLayersWarning` saying which and why, unless none can be
        (then the error says why). A call
        that selects hidden states by index (`output_hidden_states=-2`, what
        LLaVA asks of its vision tower) gets them: the last layer's output from the scan, another
        layer's by running the layers one by one, with a LayerByLayerWarning.
      options: passed to `LayerStack`: `partition_fn` (what the forward loop
        keeps for the backward: a policy of `torch_xla_ext.policies` or its
        name, `"save_nothing"` to recompute each layer in the backward),
        `is_layer_pure`, `unroll` (layers per iteration of the scan's loop, as
        `scan`'s; default 1), `per_layer_attributes` (default `("layer_idx",)`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"stack_layers: model must be an nn.Module, got {type(model).__name__}")
    adapters.teach_peft(stack_layers, unstack_layers)
    fsdp.teach_class_lookup()
    found = [layer_list(model, each) for each in
             (layer_list_paths(model) if path is None else [path])]
    stacks, refused = [], []
    for each in found:
        if isinstance(each, LayerList):
            try:
                stacks.append((each, _stack(each, options)))
            except (TypeError, ValueError) as error:
                refused.append(Unstackable(each.path, str(error), type(error)))
        elif each is not None:
            refused.append(each)
    for unstackable in refused:
        message = (f"stack_layers: cannot stack the layers at {unstackable.path!r}: "
                   f"{unstackable.reason}")
        if path is not None or not stacks:
            raise unstackable.error(f"{message}; the model is unchanged.")
        warnings.warn(f"{message}; they stay as they were, and the model's other layer lists "
                      f"are stacked.", UnstackedLayersWarning, stacklevel=2)
    # Every stack is made before any is put in place: a refusal leaves the model unchanged.
    owners = {}
    for each, stack in stacks:
        setattr(each.owner, each.name, stack)
        owners.setdefault(id(each.owner), (each.owner, []))[1].append(each.name)
    for owner, names in owners.values():
        drive_loops(owner, (*loop_names(owner), *names), OwnerPlans().start)
    return model


def _stack(found: LayerList, options: dict) -> StackedLayers:
    """The stack that stands for the layer list `found`."""
    recorded = recorded_outputs(found.recorder)
    if recorded:
        # transformers puts these hooks on the layers at the first call that asks for
        # per-layer outputs; a stack replays its template's (a copy of a layer) after
        # each scan, so they must be on the layers before it copies them.
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
        maybe_install_capturing_hooks(found.recorder)
    return StackedLayers(found.layers, found.config, recorded, **options)


def unstack_layers(model: nn.Module, path: str | None = None) -> nn.Module:
    """Undoes `stack_layers` in place; returns `model`.

    Each `StackedLayers` of the model (only the one at `path`, if given)
    becomes an `nn.ModuleList` of its layers, each holding parameters and
    buffers of its own, copied from its slices of the stacked ones (which
    are dropped). For code that must find each layer among the model's
    modules; `stack_layers(model)` stacks them again."""
    for each in stacked_paths(model) if path is None else [path]:
        stack = submodule(model, each)
        if not isinstance(stack, StackedLayers):
            raise TypeError(f"unstack_layers: {each!r} is a {type(stack).__name__}, not the "
                            f"StackedLayers that stack_layers made; pass the path of that.")
        parent_path, _, name = each.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, name, nn.ModuleList(stack.unstacked()).train(stack.training))
        names = tuple(other for other in loop_names(parent) if other != name)
        undrive_loops(parent)
        if names:
            drive_loops(parent, names, OwnerPlans().start)
    return model


def stacked_paths(model: nn.Module) -> list[str]:
    """The paths of the model's stacks."""
    return [name for name, module in model.named_modules() if isinstance(module, StackedLayers)]
