"""How a call of the stacked decoder layers with a transformers key/value
cache (`past_key_values`) runs: `plan_cache_call` decides it once per call,
and the stack runs its plan as one scan, or the layers one by one.

* An empty `DynamicCache` (what `use_cache=True`, most configs' default,
  makes in training and in a prompt's prefill): the scan records each
  layer's keys and values and fills the cache after the loop, detached from
  the autograd graph. Where every layer keeps all it gets (full attention, or
  a sliding window longer than what it holds), the cache's layers then read
  their slices of two stacked buffers `[layers, batch, kv_heads, length,
  head_dim]`; else each layer gets its own, as its update would leave it.
* A `DynamicCache` that holds as many tokens in every layer, none of which a
  sliding window drops with the new ones (each decoding step of `generate()`
  with the default cache), under `torch.no_grad()`: each layer reads its
  slices of the two stacked buffers (stacked first, one copy, if the cache
  was filled layer by layer), followed by its new keys and values, which are
  appended to the buffers after the loop (one copy of the cache, as each
  unconverted layer's own concatenation makes). An empty cache is this case
  with nothing held.
* A `StaticCache` of full-attention layers (what `generate(...,
  cache_implementation="static")` makes, transformers' advice on XLA), and of
  sliding-window ones while their window holds the cache's tokens and the new
  ones (a window at least the cache's length: Mistral's and Gemma's 4096):
  its keys and values live in two stacked buffers `[layers, batch, kv_heads,
  max_cache_len, head_dim]`, each layer of the cache reading and writing its
  slices as its `keys` and `values` (so `get_seq_length`, `reset` and beam
  reordering work as before; no view is kept, which torch_xla would
  materialize as a copy). The prefill's scan fills the empty cache; each
  decoding step's scan, under `torch.no_grad()`, writes only the new
  positions, in place.
* An empty `EncoderDecoderCache` (an encoder-decoder model's decoder: BART's,
  Whisper's and T5's in a prompt's prefill, Whisper's and T5's in training;
  for T5's blocks after the first, empty from slot `first` on): the scan
  records each layer's self-attention and cross-attention keys and values,
  and fills both caches after the loop, detached, marking the cross-attention
  ones computed, as the layers' own updates leave it. Its decoding steps run
  layer by layer.
* A cache of other kinds (its cache layers: linear attention's states, an
  indexer's keys), or one that keeps per-layer lists besides its layers
  (state its methods read and write at the layer's index), whose slots of
  the scan's layers hold nothing yet: each step fills a fresh one-layer
  cache of the cache's own class, and the cache gets each layer's slot
  after the loop (`fresh_caches`). Under `torch.no_grad()`, so is one whose
  cache layers hold state alike at each position (a hybrid model's decoding
  step: Mamba's states beside attention's keys and values), each step's
  one-layer cache holding its layer's slices of the stacked states.
* Layers of kinds that run as a few scans (a `StackedList`'s runs) with an
  empty `DynamicCache`: each segment's scan fills that segment's layers of
  the cache after it, layer by layer.

Any other call (a sliding window that drops tokens, a cache of another kind
or state, gradients through a cache that holds tokens, layers not on an XLA
device) runs the layers one by one, each reading and updating its own slot
of the cache, with the same results as before the conversion and a
`LayerByLayerWarning` giving one of the `REASONS` (or, off XLA,
`layer_stack.executors.device_reason`). How the cache is recorded,
written and held around the scan is `torch_xla_ext.hf.caches`.
"""
from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import (
    DynamicLayer, DynamicSlidingWindowLayer, EncoderDecoderCache, StaticLayer,
    StaticSlidingWindowLayer)

from torch_xla_ext.class_swaps import original_class
from torch_xla_ext.diagnostics import Refusal
from torch_xla_ext.hf.fresh_caches import (
    fill_fresh, fresh_layers, held_states, holds_alike_states, side_lists, starts_empty_from)
from torch_xla_ext.hf.caches import (
    advance, appended, appended_encoder_decoder, extend, fill_encoder_decoder, fill_stacked,
    hold_stacked, keeps_all, keys_and_values_per_position, reads_one_stack, stacked_buffers,
    written_in_place)
from torch_xla_ext.layer_stack import Recording, device_reason


# Why a call with a cache runs the layers one by one (`LayerByLayerWarning`).
CACHE_REASON = (
    "the key/value cache passed (past_key_values) is of a kind, or in a state, in which each "
    "layer reads and updates its own slot of it; one scan stands for the layers with a "
    "DynamicCache or an EncoderDecoderCache that starts empty (training, or a prompt's "
    "prefill), a DynamicCache that holds as many tokens in every layer (decoding), and a "
    "StaticCache, as long as no sliding window is full "
    "or fills up in the call (a window drops tokens)")
DYNAMIC_GRADIENTS_REASON = (
    "a DynamicCache that holds tokens keeps the keys and values the scan adds without their "
    "gradients; decode under torch.no_grad() (as generate() does) to run it as one scan")
STATIC_GRADIENTS_REASON = (
    "a StaticCache that holds tokens is written in place inside the scan, without gradients; "
    "decode under torch.no_grad() (as generate() does) to run it as one scan")
REASONS = (CACHE_REASON, DYNAMIC_GRADIENTS_REASON, STATIC_GRADIENTS_REASON)

# The cache layers a scan appends to: they give back what they hold followed
# by what an update puts in (all of it while no window drops a token).
_APPENDED_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)
# The cache layers a scan writes in place (each holds max_cache_len positions).
_WRITTEN_LAYERS = (StaticLayer, StaticSlidingWindowLayer)


@dataclasses.dataclass(frozen=True)
class CachePlan:
    """One scan of a call with `cache`, given to the layers as `parameter`
    (`past_key_values`; GPT-NeoX's `layer_past`): the scan covers the cache's
    layers `first`, `first + 1`, ..., in order; `held` is the stacked keys
    and values the cache holds (none: an empty cache). A StaticCache
    (`in_place`) is written in place, inside the scan once it holds its
    buffers, else filled after it; a DynamicCache is appended to after the
    scan, as stacked buffers where every layer keeps all (`stacked`), else
    layer by layer. `period`: the layers of each scan step, called as a
    group (a run over a repeating pattern), else one."""
    cache: object
    parameter: str
    in_place: bool
    held: tuple[torch.Tensor, ...] = ()
    stacked: bool = False
    first: int = 0
    period: int | None = None
    encoder_decoder: bool = False  # an empty EncoderDecoderCache
    count: int = 0  # the cache's layers the scan covers, when it holds them as stacked buffers
    # A cache of other kinds, or with per-layer lists of its own, whose slots
    # start empty: each step fills a fresh one-layer cache (`fresh_caches`).
    fresh: Recording | None = None

    @property
    def layers(self) -> list:
        """The cache's layers the scan covers, in order."""
        return self.cache.layers[self.first:self.first + self.count]

    @property
    def recording(self) -> Recording:
        """What each layer of the scan gets as its cache, and records."""
        if self.fresh is not None:
            return self.fresh
        if self.period is not None:
            return keys_and_values_per_position(self.parameter, self.period)
        if self.encoder_decoder:
            return appended_encoder_decoder(self.parameter)
        if self.in_place and self.held:
            return written_in_place(self.parameter)
        return appended(self.parameter, self.cache.layers[self.first].max_cache_len
                        if self.in_place else None)

    @property
    def state(self) -> tuple[torch.Tensor, ...]:
        """The scan's state: what the cache holds (and, written in place, its length)."""
        if self.in_place and self.held:
            return (*self.held, self.cache.layers[self.first].cumulative_length)
        return self.held

    def commit(self, recorded: tuple, found, new_tokens: int) -> None:
        """Leaves the cache as the layers' own updates of `new_tokens` tokens
        would have, from what the scan recorded (and what its step's trace
        found, `Recording.found`)."""
        if self.fresh is not None:
            fill_fresh(self.cache, found, recorded, self.first, self.count, self.period)
        elif self.encoder_decoder:
            fill_encoder_decoder(self.cache, recorded, self.first)
        elif self.in_place:
            if self.held:
                advance(self.layers, new_tokens)
            else:
                fill_stacked(self.layers, *recorded)
        elif self.stacked:
            keys, values = recorded
            if self.held:  # the new ones follow them
                keys, values = (torch.cat([held, new], dim=-2)
                                for held, new in zip(self.held, recorded))
            hold_stacked(self.layers, keys, values, new_tokens)
        else:
            for offset, (keys, values) in enumerate(self._per_layer(recorded)):
                extend(self.cache, self.first + offset, keys, values)

    def _per_layer(self, recorded: tuple) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's recorded keys and values, in the layers' order."""
        if self.period is None:
            keys, values = recorded
            return [(keys[index], values[index]) for index in range(keys.shape[0])]
        # Each position of the groups: its keys and values, stacked by group.
        return [(recorded[2 * position][group], recorded[2 * position + 1][group])
                for group in range(recorded[0].shape[0]) for position in range(self.period)]


def plan_cache_call(cache, parameter: str, num_layers: int, new_tokens: int,
                    device: torch.device, gradients: bool, first: int = 0,
                    period: int | None = None) -> CachePlan | Refusal:
    """The plan of one scan over layers `first`, ..., `first + num_layers - 1`
    called with `cache` as `parameter` on `new_tokens` tokens on `device`
    (`gradients`: whether what the layers compute carries gradients), or a
    Refusal: why the layers run one by one instead (one of `REASONS`, or the
    device's). `period`: the layers of each scan step, called as a group (a
    segment of a repeating pattern), whose cache starts empty or holds
    states alike at each position (`fresh_caches`)."""
    on_another_device = device_reason(device)
    if on_another_device is not None:
        return Refusal(on_another_device)
    if cache is None:
        return Refusal(CACHE_REASON)
    if isinstance(cache, EncoderDecoderCache):
        if period is None and holds_nothing(cache, first, num_layers):
            return CachePlan(cache, parameter, in_place=False, first=first, encoder_decoder=True)
        return Refusal(CACHE_REASON)
    if side_lists(cache):  # per-layer state besides its layers, which only its methods know
        return _fresh_plan(cache, parameter, first, num_layers, period, gradients)
    layers = _layer_range(cache, first, num_layers)
    if period is not None:  # groups of layers: an empty cache, or one for `_fresh_plan`
        if _holds_nothing(cache, first, first + num_layers):
            return CachePlan(cache, parameter, in_place=False, first=first, period=period)
        return _fresh_plan(cache, parameter, first, num_layers, period, gradients)
    if layers is not None and all(original_class(layer) in _WRITTEN_LAYERS
                                  for layer in layers):
        return _static_plan(cache, parameter, layers, first, new_tokens, gradients)
    if _holds_nothing(cache, first, first + num_layers):
        return CachePlan(cache, parameter, in_place=False, first=first, count=num_layers,
                         stacked=layers is not None
                         and all(keeps_all(layer, new_tokens) for layer in layers))
    if layers is not None and _holds_tokens(layers, new_tokens):
        if gradients:
            return Refusal(DYNAMIC_GRADIENTS_REASON)
        return CachePlan(cache, parameter, in_place=False, held=stacked_buffers(layers),
                         stacked=True, first=first, count=num_layers)
    return _fresh_plan(cache, parameter, first, num_layers, period, gradients)


def _fresh_plan(cache, parameter: str, first: int, num_layers: int, period: int | None,
                gradients: bool) -> CachePlan | Refusal:
    """The plan for a cache of other kinds than the plans above know (its
    cache layers', or lists it keeps besides them), whose slots of the
    layers hold nothing yet, or state alike at each position (see
    `fresh_caches`), or the reason the layers run one by one."""
    if starts_empty_from(cache, first, num_layers, period):
        return CachePlan(cache, parameter, in_place=False, first=first, period=period,
                         count=num_layers, fresh=fresh_layers(cache, parameter, first, period))
    # A cache of keys and values only stays with the plans above, which run
    # it one by one where its windows drop tokens or its lengths differ.
    layers = _layer_range(cache, first, num_layers) or []
    if all(original_class(layer) in _APPENDED_LAYERS + _WRITTEN_LAYERS for layer in layers) or (
            not holds_alike_states(cache, first, num_layers, period)):
        return Refusal(CACHE_REASON)
    if gradients:
        return Refusal(DYNAMIC_GRADIENTS_REASON)
    return CachePlan(cache, parameter, in_place=False, first=first, period=period,
                     count=num_layers, held=held_states(cache, first, num_layers, period),
                     fresh=fresh_layers(cache, parameter, first, period, held=True))


def _static_plan(cache, parameter: str, layers: list, first: int, new_tokens: int,
                 gradients: bool) -> CachePlan | Refusal:
    """The plan for a StaticCache whose layers all hold as many positions and
    none of which slides in the call: a sliding-window layer whose window is
    at least the cache's length holds what it holds and the new tokens, and
    updates as a full-attention one (it writes the new keys and values at its
    next positions and gives back its whole buffers), where one that is full
    drops its oldest position."""
    if (len({layer.max_cache_len for layer in layers}) != 1
            or any(layer.is_sliding and layer.cumulative_length_int + new_tokens
                   > layer.max_cache_len for layer in layers)):
        return Refusal(CACHE_REASON)
    initialized = [layer.is_initialized for layer in layers]
    if not any(initialized):
        return CachePlan(cache, parameter, in_place=True, first=first, count=len(layers))
    if not all(initialized):
        return Refusal(CACHE_REASON)
    if gradients:
        return Refusal(STATIC_GRADIENTS_REASON)
    return CachePlan(cache, parameter, in_place=True, held=stacked_buffers(layers), first=first,
                     count=len(layers))


def _layer_range(cache, first: int, num_layers: int) -> list | None:
    """The cache's layers `first`, ..., `first + num_layers - 1`, if it has
    them (one per decoder layer) and keeps them on the device (not
    offloaded); else None."""
    layers = getattr(cache, "layers", None)
    if (not isinstance(layers, list) or len(layers) < first + num_layers
            or getattr(cache, "offloading", False)):
        return None
    return layers[first:first + num_layers]


def _holds_nothing(cache, start: int, stop: int) -> bool:
    """Whether `cache` is a DynamicCache (of full or sliding-window layers,
    made up front from the config or added at each layer's first update)
    whose layers start, ..., stop - 1 hold nothing yet (the layers before them
    may: an earlier segment's scan filled them)."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return False
    added = getattr(cache, "layer_class_to_replicate", None)
    if len(layers) == start and added is not None:
        return original_class(added) in _APPENDED_LAYERS
    return (len(layers) >= stop
            and all(original_class(layer) in _APPENDED_LAYERS for layer in layers[start:stop])
            and not any(getattr(layer, "is_initialized", True) for layer in layers[start:stop]))


def holds_nothing(cache, first: int, num_layers: int) -> bool:
    """Whether `cache` (a DynamicCache, or an EncoderDecoderCache of two)
    holds nothing yet in the slots of layers `first`, ..., `first +
    num_layers - 1`: those layers see no earlier token."""
    parts = ((cache.self_attention_cache, cache.cross_attention_cache)
             if isinstance(cache, EncoderDecoderCache) else (cache,))
    return all(_holds_nothing(part, first, first + num_layers) for part in parts)


def starts_empty(cache) -> bool:
    """Whether `cache` is a DynamicCache whose layers all hold nothing yet."""
    return _holds_nothing(cache, 0, len(getattr(cache, "layers", ())))


def _holds_tokens(layers: list, new_tokens: int) -> bool:
    """Whether the layers (a DynamicCache's, one per decoder layer) all hold
    keys and values of one shape and, with `new_tokens` more, drop none (full
    attention, or a window that holds them all): each layer's update then
    gives back what it holds followed by the new ones, and keeps that."""
    if any(original_class(layer) not in _APPENDED_LAYERS or not layer.is_initialized
           for layer in layers):
        return False
    if not reads_one_stack(layers) and len(
            {(layer.keys.shape, layer.values.shape, layer.keys.dtype, layer.keys.device)
             for layer in layers}) != 1:
        return False
    # [batch, heads, length, head_dim] of at least one position (a layer made
    # by `early_initialization` holds a 1-d empty tensor).
    shape = layers[0].keys.shape
    return (len(shape) == 4 and shape[-2] > 0
            and all(keeps_all(layer, shape[-2] + new_tokens) for layer in layers))
