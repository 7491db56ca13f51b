"""Hugging Face transformers models whose decoder layers run as one `scan`,
under the model's own, unmodified `forward`.

`stack_layers(model)` replaces the decoder-layer `nn.ModuleList` of a
transformers model (`model.model.layers` of Llama, Mistral, Qwen2, ...) by a
`StackedLayers`: a `LayerStack` that holds every weight once, stacked along a
leading layer dimension. The model's forward loops
`for decoder_layer in self.layers[: self.config.num_hidden_layers]`; a slice
of all the layers of a `StackedLayers` is a list of one callable, the stack
itself, which runs every layer as one scan. A forward that iterates over the
layers (`for block in self.h`, GPT-2's) gets the stack first, then callables
that hand the hidden state on. Everything else about the model
stays as it was: its forward, its config, the rest of its modules, and the
per-layer names of its `state_dict()`.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import re
import sys
import textwrap
from typing import Iterable

import torch
from torch import nn

from torch_xla_ext.layer_stack import LayerStack
from torch_xla_ext.layer_stack.groups import GroupedLayers, LayerGroup
from torch_xla_ext.layer_stack.running import (
    Recording, Unscannable, run_layer_by_layer, run_recording)

__all__ = ["StackedLayerKinds", "StackedLayers", "stack_layers", "unstack_layers"]

# Output flags of transformers models that collect something from every layer
# (`output_hidden_states`, `output_attentions`, ...); a scan has no per-layer outputs.
_PER_LAYER_OUTPUTS = ("hidden_states", "attentions")

# transformers' own output-capturing hooks are inactive unless an output is
# requested, and a StackedLayers refuses such requests itself.
_TRANSFORMERS_CAPTURE_HOOKS = "transformers.utils.output_capturing"

_CACHE_REASON = (
    "the key/value cache passed (past_key_values) is a DynamicCache that already holds "
    "tokens, or a cache of another kind, and each layer reads and updates its own slot of it; "
    "one scan stands for the layers when a DynamicCache starts empty (training, or a prompt's "
    "prefill) and for every call with a StaticCache of full-attention layers")

# The cache layers that give back what an update puts in when they start empty,
# so that a layer computes the same with one of them as with no cache.
_GROWING_CACHE_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")


class _RecordingCache:
    """The cache each layer gets inside the scan in place of an empty cache:
    it keeps the keys and values the layer puts in and gives them back as the
    empty cache would: unchanged (DynamicCache), or followed by zeros up to
    the cache's length `padded_to` (StaticCache)."""

    def __init__(self, padded_to: int | None = None):
        self.keys = self.values = None
        self.padded_to = padded_to

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        self.keys, self.values = key_states, value_states
        if self.padded_to is None:
            return key_states, value_states
        return tuple(_padded(new, self.padded_to) for new in (key_states, value_states))


def _padded(keys_or_values: torch.Tensor, length: int) -> torch.Tensor:
    """Followed by zeros along the sequence (next-to-last) dimension, to `length`."""
    return torch.nn.functional.pad(keys_or_values, (0, 0, 0, length - keys_or_values.shape[-2]))


def _recorded_keys_and_values(cache: _RecordingCache) -> tuple:
    if cache.keys is None:
        raise ValueError("stack_layers: the decoder layer called with a key/value cache did not "
                         "update it, so there are no keys and values to fill the cache with")
    # Detached: what the cache holds is read by later decoding steps, not differentiated.
    return cache.keys.detach(), cache.values.detach()


@functools.cache
def _keys_and_values(parameter: str, padded_to: int | None = None) -> Recording:
    """The recording of each layer's keys and values through its cache
    argument `parameter` (`past_key_values`; GPT-NeoX's `layer_past`)."""
    return Recording(("keys and values", parameter, padded_to),
                     lambda index, state: {parameter: _RecordingCache(padded_to)},
                     lambda given: _recorded_keys_and_values(given[parameter]))


class _StackedCacheWriter:
    """The cache each layer gets inside the scan over a StaticCache's stacked
    buffers (the scan's state: keys, values, the cache's length): as
    StaticLayer.update, its update writes the new keys and values at the
    cache's next positions and gives back the layer's whole buffers, but it
    writes them into the layer's slice of the stacked buffers, in place."""

    def __init__(self, index: torch.Tensor, state: tuple):
        self.index = index.reshape(1)
        self.keys, self.values, self.length = state

    def update(self, key_states, value_states, layer_idx=None, cache_kwargs=None):
        batch, heads, length, _ = key_states.shape
        device = key_states.device
        # The leading four dimensions' indices, broadcast to [batch, heads,
        # length]: a scatter of head_dim rows, with no transposition of the
        # stacked buffers (which would copy them).
        where = (self.index.view(1, 1, 1),
                 torch.arange(batch, device=device).view(batch, 1, 1),
                 torch.arange(heads, device=device).view(1, heads, 1),
                 (self.length + torch.arange(length, device=device)).view(1, 1, length))
        for stacked, new in ((self.keys, key_states), (self.values, value_states)):
            stacked.index_put_(where, new.to(stacked.dtype))
        return (self.keys.index_select(0, self.index)[0],
                self.values.index_select(0, self.index)[0])


@functools.cache
def _written_in_place(parameter: str) -> Recording:
    """Each layer's keys and values written into a StaticCache's stacked
    buffers, in place."""
    return Recording(("stacked static cache", parameter),
                     lambda index, state: {parameter: _StackedCacheWriter(index, state)},
                     lambda given: ())


def _stacked_slice(buffer: str) -> property:
    """A cache layer's `keys` or `values` as its slice of the stacked buffer,
    taken at each read; assigning it (beam search's reordering) writes the slice."""

    def read(layer) -> torch.Tensor:
        return getattr(layer, buffer)[layer._stacked_index]

    def write(layer, new: torch.Tensor) -> None:
        getattr(layer, buffer)[layer._stacked_index].copy_(new)

    return property(read, write)


@functools.cache
def _reading_stacked_buffers(layer_class: type) -> type:
    """The class a StaticCache layer takes once its cache is stacked: a
    subclass of the same name (what checks a cache layer's kind by name still
    sees it) whose keys and values are its slices of the stacked buffers. A
    view held by the layer would not do: torch_xla materializes every live
    view at a sync, which would keep a second copy of the cache."""
    return type(layer_class.__name__, (layer_class,), {
        "__module__": layer_class.__module__, "__qualname__": layer_class.__qualname__,
        "keys": _stacked_slice("_stacked_keys"), "values": _stacked_slice("_stacked_values"),
        "reads_stacked_buffers": True})


class StackedLayers(LayerStack):
    """The decoder layers of a transformers model, stacked (see `stack_layers`).

    A `LayerStack` with what a transformers model's forward needs:

    * `layers[a:b]` covering all the layers is `[layers]`: the model's loop calls
      the stack once, which runs every layer as one scan; an empty DynamicCache
      passed to it is filled from the scan; a StaticCache is held as stacked
      buffers that the scan writes in place (prefill and every decoding step);
      a DynamicCache holding tokens makes it run layer by layer. Any other slice is the list of those layers;
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
        # (file, first line) of the forward whose loop iterates over the layers, if any.
        self.iterated_by: tuple[str, int] | None = None
        if config is not None and self._template is not None:
            _share_config(self._template, layers[0], config)

    def __getitem__(self, index):
        if isinstance(index, slice) and range(len(self))[index] == range(len(self)):
            return [self]
        return super().__getitem__(index)

    def __iter__(self):
        caller = sys._getframe(1).f_code
        if self.iterated_by == (caller.co_filename, caller.co_firstlineno):
            # The model's loop calls the stack, which runs every layer, then hands
            # the hidden state on through the other iterations.
            return iter([self, *[_hand_on] * (len(self) - 1)])
        return super().__iter__()

    def forward(self, hidden_states, *args, **kwargs):
        _refuse_per_layer_outputs(self, kwargs)
        keywords = (None if self._template is None
                    else _with_cache_by_name(self._template, hidden_states, args, kwargs))
        if keywords is None:
            return super().forward(hidden_states, *args, **kwargs)
        parameter, cache = next((name, value) for name, value in keywords.items()
                                if _is_cache(value))
        reason = _CACHE_REASON
        if hidden_states.device.type != "xla":
            reason = (f"the layers run on {hidden_states.device.type}, and the scan is an XLA "
                      f"loop")
        else:
            try:
                static = _static_cache(cache, len(self))
                if static == "filled":
                    return self._scan_writing(cache, parameter, hidden_states, keywords)
                if static == "empty" or _starts_empty(cache, len(self)):
                    return self._scan_filling(cache, parameter, hidden_states, keywords)
            except Unscannable as unscannable:
                reason = str(unscannable)
        return run_layer_by_layer(self.__getitem__, len(self), hidden_states, args, kwargs,
                                  drop_in=False, reason=reason)

    def _scan_filling(self, cache, parameter: str, hidden_states, keywords: dict):
        """One scan over the layers, each given a cache that records its keys and
        values; they fill `cache` after the loop, layer by layer, as the layers'
        own updates would have."""
        without_cache = {name: value for name, value in keywords.items() if name != parameter}
        static = _static_cache(cache, len(self)) == "empty"
        recording = _keys_and_values(parameter, cache.layers[0].max_cache_len if static else None)
        hidden_states, (keys, values) = run_recording(self._layers(), hidden_states, (),
                                                      without_cache, recording)
        if static:
            _fill_stacked(cache, keys, values)
            return hidden_states
        for index in range(len(self)):
            cache.update(keys[index], values[index], index)
        return hidden_states

    def _scan_writing(self, cache, parameter: str, hidden_states, keywords: dict):
        """One scan over the layers and the StaticCache's stacked buffers, each
        layer writing its new keys and values into its slice in place."""
        if torch.is_grad_enabled() and any(tensor.requires_grad
                                           for tensor in self.parameters()):
            raise Unscannable(
                "a StaticCache that holds tokens is written in place inside the scan, without "
                "gradients; decode under torch.no_grad() (as generate() does) to run it as one "
                "scan")
        keys, values = _stacked_buffers(cache)
        lengths = [layer.cumulative_length for layer in cache.layers]
        without_cache = {name: value for name, value in keywords.items() if name != parameter}
        hidden_states, _ = run_recording(self._layers(), hidden_states, (), without_cache,
                                         _written_in_place(parameter),
                                         state=(keys, values, lengths[0]))
        for length in lengths:
            length.add_(hidden_states.shape[-2])
        return hidden_states



class StackedLayerKinds(GroupedLayers):
    """The decoder layers of a transformers model whose `config.layer_types`
    mixes kinds (Gemma2's alternating sliding and full attention, Gemma3's
    pattern, Qwen2's first `max_window_layers`), stacked as a few scans by
    their pattern of kinds (see `torch_xla_ext.layer_stack.groups`): the
    model's loop `for i, layer in enumerate(self.layers[: n])` calls each
    layer with its kind's mask and rotary table, and each segment's layers
    run as one scan. With an empty DynamicCache (what use_cache=True, most
    configs' default, makes in training and in a prompt's prefill) each
    segment's scan records every layer's keys and values and fills the
    cache after it; a call with a cache that holds tokens, or of another
    kind, runs the layers one by one (each reads and updates its own slot),
    with a LayerByLayerWarning. Calls that ask for each layer's output raise,
    as StackedLayers'."""

    def __init__(self, layers: Iterable[nn.Module], kinds: list, config,
                 recorded_outputs: Iterable[str] = _PER_LAYER_OUTPUTS, **options):
        layers = list(layers)
        super().__init__(layers, kinds, **options)
        self.model_config = config
        self.recorded_outputs = tuple(recorded_outputs)
        if config is not None:
            for segment, stack in zip(self.plan, self.segments):
                _share_config(stack._template,
                              LayerGroup(layers[segment.start:segment.start + segment.period]),
                              config)

    def _run_segment(self, segment, stack, hidden, calls: tuple):
        _refuse_per_layer_outputs(self, calls[-1][1])
        caches = {(name, id(value)): value for _, kwargs in calls
                  for name, value in kwargs.items() if _is_cache(value)}
        if not caches and not any(_is_cache(value) for args, _ in calls for value in args):
            return stack(hidden, calls=calls)
        reason = _CACHE_REASON
        if hidden.device.type != "xla":
            reason = (f"the layers run on {hidden.device.type}, and the scan is an XLA loop")
        elif len(caches) == 1:
            (parameter, _), cache = next(iter(caches.items()))
            if _segment_starts_empty(cache, segment.start, segment.stop):
                try:
                    return _scan_filling_groups(stack, segment, cache, parameter, hidden, calls)
                except Unscannable as unscannable:
                    reason = str(unscannable)
        return run_layer_by_layer(stack.__getitem__, segment.groups, hidden, (),
                                  {"calls": calls}, drop_in=False, reason=reason)


def _scan_filling_groups(stack, segment, cache, parameter: str, hidden, calls: tuple):
    """One scan over a segment's groups, each layer given a cache that records
    its keys and values; they fill `cache` after the loop, layer by layer in
    order, as the layers' own updates would have."""
    without_cache = tuple((args, {name: value for name, value in kwargs.items()
                                  if name != parameter}) for args, kwargs in calls)
    hidden, recorded = run_recording(stack._layers(), hidden, (), {"calls": without_cache},
                                     _keys_and_values_per_position(parameter, segment.period))
    for group in range(segment.groups):
        for position in range(segment.period):
            keys, values = recorded[2 * position], recorded[2 * position + 1]
            cache.update(keys[group], values[group],
                         segment.start + group * segment.period + position)
    return hidden


@functools.cache
def _keys_and_values_per_position(parameter: str, period: int) -> Recording:
    """The recording of the keys and values of each layer of a group of
    `period` layers, through their cache argument `parameter`."""
    return Recording(
        ("keys and values per position", parameter, period),
        lambda index, state: {"per_position": tuple({parameter: _RecordingCache()}
                                                    for _ in range(period))},
        lambda given: tuple(tensor for position in given["per_position"]
                            for tensor in _recorded_keys_and_values(position[parameter])))


# The stacks that stack_layers makes.
_STACKS = (StackedLayers, StackedLayerKinds)


def _refuse_per_layer_outputs(stack: nn.Module, kwargs: dict) -> None:
    """Raises if the call asks for every layer's output, which a scan does not have."""
    requested = [name for name in stack.recorded_outputs
                 if _output_requested(stack.model_config, f"output_{name}", kwargs)]
    if requested:
        flags = ", ".join(f"output_{name}" for name in requested)
        raise ValueError(
            f"stack_layers: the call asks for every decoder layer's output ({flags}), "
            f"but the stacked layers run as one scan, which has none. Call the model without "
            f"{flags} (and set it to False in model.config), or use a model that "
            f"stack_layers did not convert for this call.")


def _output_requested(config, flag: str, kwargs: dict) -> bool:
    # As transformers decides: the call's flag, else the config's.
    return bool(kwargs[flag] if flag in kwargs else getattr(config, flag, False))


def _is_cache(value) -> bool:
    """A transformers key/value cache (`Cache`: DynamicCache, StaticCache, ...)."""
    return hasattr(value, "get_seq_length") and hasattr(value, "update")


def _with_cache_by_name(template: nn.Module, hidden_states, args: tuple, kwargs: dict
                        ) -> dict | None:
    """The call's arguments after the hidden state, each by its parameter's name
    (GPT-2 passes its cache by position), when one of them is a key/value
    cache; else None."""
    if not any(_is_cache(value) for value in (*args, *kwargs.values())):
        return None
    if not args:
        return dict(kwargs)
    signature = inspect.signature(type(template).forward)
    bound = signature.bind(template, hidden_states, *args, **kwargs)
    keywords = {}
    for name, value in list(bound.arguments.items())[2:]:  # after self and the hidden state
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            return None  # positional past the named ones: left to the layer-by-layer path
        keywords.update(value if kind is inspect.Parameter.VAR_KEYWORD else {name: value})
    return keywords


def _hand_on(hidden_states, *args, **kwargs):
    """A layer of an iterating loop after the stack: the stack ran them all."""
    return hidden_states


def _static_cache(cache, num_layers: int) -> str | None:
    """"empty" or "filled" for a StaticCache of full-attention layers, one per
    layer, not offloaded (what `cache_implementation="static"` makes); else None."""
    layers = getattr(cache, "layers", None)
    if (not isinstance(layers, list) or len(layers) != num_layers or getattr(cache, "offloading", False)
            or any(type(layer).__name__ != "StaticLayer" for layer in layers)):
        return None
    initialized = [layer.is_initialized for layer in layers]
    if all(initialized):
        return "filled"
    return "empty" if not any(initialized) else None


def _bind_stacked(cache, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Makes each cache layer's tensors its slices of `keys`/`values`."""
    for index, layer in enumerate(cache.layers):
        # Its own tensors go: the slices replace them.
        layer.__dict__.pop("keys", None)
        layer.__dict__.pop("values", None)
        layer.__class__ = _reading_stacked_buffers(type(layer))
        layer._stacked_keys, layer._stacked_values, layer._stacked_index = keys, values, index


def _fill_stacked(cache, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Fills an empty StaticCache with a prefill's stacked keys and values
    [layers, batch, heads, length, head_dim], its buffers stacked."""
    for index, layer in enumerate(cache.layers):
        layer.lazy_initialization(keys[index], values[index])  # shapes; its zeros stay unmade
    length = keys.shape[-2]
    _bind_stacked(cache, *(_padded(new.to(layer_tensor.dtype), layer_tensor.shape[-2])
                           for new, layer_tensor in ((keys, cache.layers[0].keys),
                                                     (values, cache.layers[0].values))))
    for layer in cache.layers:
        layer.cumulative_length.add_(length)


def _stacked_buffers(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The filled StaticCache's stacked key and value buffers. Stacks its
    layers' tensors first (one copy) when it was filled layer by layer."""
    if not all(getattr(layer, "reads_stacked_buffers", False) for layer in cache.layers):
        _bind_stacked(cache, torch.stack([layer.keys for layer in cache.layers]),
                      torch.stack([layer.values for layer in cache.layers]))
    return cache.layers[0]._stacked_keys, cache.layers[0]._stacked_values


def _segment_starts_empty(cache, start: int, stop: int) -> bool:
    """Whether layers start, ..., stop - 1 of a DynamicCache hold nothing yet
    (the layers before them may: an earlier segment's scan filled them)."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return False
    added = getattr(cache, "layer_class_to_replicate", None)
    if len(layers) == start and added is not None:
        return added.__name__ in _GROWING_CACHE_LAYERS
    return (len(layers) >= stop
            and all(type(layer).__name__ in _GROWING_CACHE_LAYERS for layer in layers[start:stop])
            and not any(getattr(layer, "is_initialized", True) for layer in layers[start:stop]))


def _starts_empty(cache, num_layers: int) -> bool:
    """Whether `cache` is a DynamicCache (of full or sliding-window layers, made
    up front from the config or added at each layer's first update) whose
    layers hold nothing yet."""
    return _segment_starts_empty(cache, 0, num_layers)


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
    (one trace, one XLA While loop forward and backward); its weights are
    held once, stacked (`model.model.layers.stacked.self_attn.q_proj.weight`
    is `[num_layers, out, in]`), and receive the gradients. With an empty
    `DynamicCache` (what `use_cache=True`, most configs' default, makes in
    training and in a prompt's prefill) the scan records each layer's keys
    and values and fills the cache after the loop, detached from the autograd
    graph. A `StaticCache` of full-attention layers (what
    `generate(..., cache_implementation="static")` makes, transformers'
    advice on XLA) runs as one scan in the prefill and in every decoding step:
    its keys and values live in two stacked buffers
    `[layers, batch, kv_heads, max_cache_len, head_dim]`, each layer of the
    cache reads and writes its slices as its `keys` and `values` (so
    `get_seq_length`, `reset` and beam reordering work as before; no view is
    kept, which torch_xla would materialize as a copy), and each step's scan writes only the new
    positions, in place, under `torch.no_grad()`. With a `DynamicCache` that
    already holds tokens (each decoding step of `generate()` with the default
    cache) or a cache of another kind, the layers run one by one, each with
    its own cache slot, and give the same results as before the conversion;
    a `LayerByLayerWarning` says so (once per process, as Python shows a
    warning).

    What stays as it was: the model's forward and config, every other module,
    `state_dict()` keys and values (`model.layers.3.self_attn.q_proj.weight`),
    so `save_pretrained()` writes an ordinary checkpoint and
    `load_state_dict()` of one works; `model.model.layers[i]` (a module whose
    tensors are views of slice i of the stacked ones) and `len()`.
    `named_parameters()` names the stacked tensors
    (`model.layers.stacked.mlp.up_proj.weight`), which can be sharded with
    `mark_sharding` along any dimension but the first.

    Layers of several kinds (`config.layer_types` not all the same: Gemma2's
    alternating sliding and full attention, Gemma3's pattern, Qwen2's
    `max_window_layers`) become a `StackedLayerKinds`: the smallest repeating
    pattern of kinds runs as one scan over groups of one period of layers,
    and what does not fit whole periods (or a model whose kinds come in
    blocks) as one scan per run of one kind; a few scans in one step graph.
    The model's loop gets a callable per layer, so each layer still gets its
    kind's mask and rotary table; a later group given other arguments than
    the first group's raises. Its `state_dict()`, `len()` and `layers[i]` are
    as above; `named_parameters()` names the stacked tensors per segment
    (`model.layers.segments.0.stacked.layers.1.mlp.up_proj.weight`:
    position 1 of each group). An empty DynamicCache (use_cache=True, in
    training or a prompt's prefill) is filled from the scans, as above; with
    a cache that holds tokens (each decoding step) or a StaticCache these
    layers run one by one, with a `LayerByLayerWarning`.

    peft: `stack_layers(get_peft_model(model, config))` trains the LoRA
    adapters as one scan (the base weights stay stacked and frozen);
    `save_pretrained`, `merge_and_unload` and `unload` of the PeftModel work
    as unconverted (merge_and_unload returns the merged model stacked; see
    `torch_xla_ext.hf_peft`). Apply get_peft_model first: after
    stack_layers, peft finds no modules to adapt and refuses. peft's other
    whole-model operations (`disable_adapter`, `set_adapter`, ...) do not
    reach the stacked layers; `unstack_layers(model)` undoes the conversion.

    Not supported, and refused with an error that says so: layers of one kind
    that are not alike (a setting changed on one layer: the scan runs the
    first layer's code with each layer's weights), layers of several kinds
    under a forward that iterates over them (`for block in self.h`), layers
    with hooks or gradient checkpointing enabled (neither would run inside the
    scan), a forward that neither loops over `self.layers[...]` nor iterates
    over `self.layers` calling each layer on the hidden state alone, and calls with
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
    if isinstance(layers, _STACKS):
        return model  # converted already
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"stack_layers: {path!r} is a {type(layers).__name__}, not the "
                        f"nn.ModuleList of decoder layers; pass the path of that list.")
    parent_path, _, name = path.rpartition(".")
    owner = model.get_submodule(parent_path)
    iterated_by = _layer_loop(owner, name, path)
    config = getattr(owner, "config", getattr(model, "config", None))
    kinds = _mixed_layer_types(config, len(layers))
    if kinds is not None and iterated_by is not None:
        raise ValueError(
            f"stack_layers: the layers at {path!r} are of several kinds (config.layer_types: "
            f"{sorted(set(kinds))}), and {type(owner).__qualname__}.forward iterates over "
            f"them (`for layer in self.{name}`); stack_layers runs layers of several kinds "
            f"only under a loop over a slice `self.{name}[: n]`, which hands each layer its "
            f"kind's arguments. The model is unchanged.")
    for index, layer in enumerate(layers):
        _check_no_hooks_or_checkpointing(layer, f"{path}.{index}")
    try:
        if kinds is None:
            stack = StackedLayers(layers, config, _recorded_outputs(owner), **options)
            stack.iterated_by = iterated_by
        else:
            stack = StackedLayerKinds(layers, kinds, config, _recorded_outputs(owner), **options)
    except (TypeError, ValueError) as error:
        raise type(error)(f"stack_layers: cannot stack the layers at {path!r}: {error}") from error
    setattr(owner, name, stack)
    from torch_xla_ext import hf_peft  # peft, if the model is a PeftModel
    hf_peft.reach_stacked_adapters(model)
    return model


def unstack_layers(model: nn.Module, path: str | None = None) -> nn.Module:
    """Undoes `stack_layers` in place; returns `model`.

    The `StackedLayers` at `path` (by default the model's one StackedLayers)
    becomes an `nn.ModuleList` of the layers, each holding parameters and
    buffers of its own, copied from its slices of the stacked ones (which
    are dropped). For code that must find each layer among the model's
    modules; `stack_layers(model)` stacks them again."""
    path = _stacked_path(model) if path is None else path
    stack = _submodule(model, path)
    if not isinstance(stack, _STACKS):
        raise TypeError(f"unstack_layers: {path!r} is a {type(stack).__name__}, not the "
                        f"StackedLayers or StackedLayerKinds that stack_layers made; pass the "
                        f"path of that.")
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path), name,
            nn.ModuleList(stack.unstacked()).train(stack.training))
    return model


@contextlib.contextmanager
def layers_as_modules(model: nn.Module):
    """While the block runs, each StackedLayers of the model is replaced by an
    `nn.ModuleList` of its layers `stack[i]`, whose tensors are views of the
    stacked ones (no copies): for code that reads each layer as a module of
    the model, such as peft's save_pretrained."""
    stacks = [(model.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2],
               model.get_submodule(path)) for path in _stacked_paths(model)]
    for parent, name, stack in stacks:
        # By index: a slice of all the layers of a StackedLayers is the stack itself.
        setattr(parent, name, nn.ModuleList([stack[index] for index in range(len(stack))]))
    try:
        yield
    finally:
        for parent, name, stack in stacks:
            setattr(parent, name, stack)


def _stacked_paths(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, _STACKS)]


def _stacked_path(model: nn.Module) -> str:
    """The path of the model's one StackedLayers."""
    found = _stacked_paths(model)
    if len(found) != 1:
        raise ValueError(f"unstack_layers: {type(model).__name__} holds {len(found)} "
                         f"StackedLayers ({found}); pass path='...' naming the one meant.")
    return found[0]


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
             if isinstance(module, (nn.ModuleList, *_STACKS)) and len(module)
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
    if isinstance(layers, StackedLayerKinds):
        return type(layers.segments[0]._template.layers[0]).__name__ in class_names
    classes = {type(layer) for layer in layers}
    return len(classes) == 1 and next(iter(classes)).__name__ in class_names


def _layer_loop(owner: nn.Module, name: str, path: str) -> tuple[str, int] | None:
    """How the owner's forward calls the layers: None when it takes them as a
    slice (`for layer in self.layers[: n]`), which yields the stack itself; or
    (file, first line) of the forward when it iterates over them (`for block in
    self.h`, `enumerate(self.h)`) with a loop body that only calls the layer on
    the hidden state, for StackedLayers.__iter__ to recognize. Raises
    ValueError naming the line of a loop that does more between the layers."""
    forward = inspect.unwrap(type(owner).forward)
    try:
        lines, first_line = inspect.getsourcelines(forward)
    except (OSError, TypeError):
        lines, first_line = [], 0
    source = textwrap.dedent("".join(lines))
    if re.search(rf"self\.{re.escape(name)}\s*\[", source):
        return None
    where = type(owner).__qualname__ + ".forward"
    loop = next((node for node in ast.walk(ast.parse(source)) if source and
                 isinstance(node, ast.For) and _iterates_over(node.iter, name)), None)
    if loop is None:
        raise ValueError(
            f"stack_layers: {where} neither loops over a slice `self.{name}[...]` nor over "
            f"`self.{name}` itself (or its source is not available), so it would call the "
            f"layers at {path!r} one by one, not as one scan. stack_layers takes over loops of "
            f"the form `for layer in self.{name}[: n]` or `for layer in self.{name}`; for "
            f"other models, call a torch_xla_ext.LayerStack from your own forward.")
    layer = loop.target.elts[-1] if isinstance(loop.target, ast.Tuple) else loop.target
    body = loop.body
    if not (len(body) == 1 and _only_calls_the_layer(body[0], layer)):
        statement = next((each for each in body if not _only_calls_the_layer(each, layer)),
                         body[-1])
        line = first_line + statement.lineno - 1
        text = source.splitlines()[statement.lineno - 1].strip()
        raise ValueError(
            f"stack_layers: {where} does more between two layers than call the next one on "
            f"the hidden state ({forward.__code__.co_filename}:{line}: `{text}`); one scan "
            f"runs all the layers at once, so that work would not run between them. Move it "
            f"before or after the loop, or call a torch_xla_ext.LayerStack from your own "
            f"forward; the model is unchanged.")
    return forward.__code__.co_filename, forward.__code__.co_firstlineno


def _iterates_over(iterable: ast.expr, name: str) -> bool:
    """`self.name`, or `enumerate(self.name)`."""
    if (isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name)
            and iterable.func.id == "enumerate" and iterable.args):
        iterable = iterable.args[0]
    return (isinstance(iterable, ast.Attribute) and iterable.attr == name
            and isinstance(iterable.value, ast.Name) and iterable.value.id == "self")


def _only_calls_the_layer(statement: ast.stmt, layer: ast.expr) -> bool:
    """`hidden = layer(hidden, ...)`: the layer called on what the result replaces."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name) and isinstance(layer, ast.Name)):
        return False
    call = statement.value
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            and call.func.id == layer.id and bool(call.args)
            and isinstance(call.args[0], ast.Name) and call.args[0].id == statement.targets[0].id)


def _mixed_layer_types(config, count: int) -> list | None:
    """transformers configs list per-layer kinds (full or sliding attention) in
    `layer_types`, and the forward passes each layer the mask of its kind:
    the kinds when they are not all the same, else None."""
    layer_types = list(getattr(config, "layer_types", None) or ())[:count]
    if len(set(layer_types)) < 2:
        return None
    if len(layer_types) < count:
        raise ValueError(
            f"stack_layers: config.layer_types lists {len(layer_types)} kinds for {count} "
            f"layers; give every layer its kind (or one kind for all). The model is unchanged.")
    return layer_types


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
