"""The mechanics of transformers' key/value caches around a scan of the
decoder layers, as `torch_xla_ext.hf.cache_plan` plans them (which says what
runs how): the stand-in cache each traced layer call gets, which records the
keys and values it puts in (`appended`: a DynamicCache, or an empty
StaticCache, extended or filled after the loop; `keys_and_values_per_position`:
a group of layers' empty DynamicCache; `appended_encoder_decoder`: an empty
EncoderDecoderCache, filled after the loop by `fill_encoder_decoder`) or
writes a StaticCache's stacked buffers inside the loop (`written_in_place`),
and a cache held as two stacked buffers, its layers reading their slices
(a StaticCache: `fill_stacked`; a DynamicCache that keeps all it gets:
`hold_stacked`; either: `stacked_buffers`)."""
from __future__ import annotations

import copy
import functools

import torch
from transformers.cache_utils import (
    DynamicLayer, DynamicSlidingWindowLayer, EncoderDecoderCache, StaticLayer,
    StaticSlidingWindowLayer)

from torch_xla_ext.class_swaps import (lookalike_subclass, original_class, reduce_as_original,
                                       swap_back, swap_in)
from torch_xla_ext.layer_stack import Recording


class _AppendingCache:
    """The cache each layer gets inside the scan in place of a DynamicCache
    (the scan's state: the keys and values every layer holds, stacked, or
    nothing for an empty cache) or of an empty StaticCache: as the cache
    layer's update, it gives back what the layer holds followed by the new
    keys and values, and for a StaticCache zeros up to its length
    `padded_to`; it records the new ones, which the cache gets after the
    loop."""

    def __init__(self, index: torch.Tensor | None = None, held: tuple = (),
                 padded_to: int | None = None):
        self.keys = self.values = None
        self.index = None if index is None else index.reshape(1)
        self.held = held
        self.padded_to = padded_to

    def get_seq_length(self, layer_idx=None) -> int:
        """How many positions the layer's cache held before the call: the same
        in every layer of the scan (so its index is not read)."""
        return self.held[0].shape[-2] if self.held else 0

    def update(self, key_states, value_states, layer_idx=None, cache_kwargs=None):
        self.keys, self.values = key_states, value_states
        given = (key_states, value_states)
        if self.held:
            given = tuple(torch.cat([layer_slice(held, self.index), new], dim=-2)
                          for held, new in zip(self.held, given))
        if self.padded_to is not None:
            given = tuple(_padded(new, self.padded_to) for new in given)
        return given


def _padded(keys_or_values: torch.Tensor, length: int) -> torch.Tensor:
    """Followed by zeros along the sequence (next-to-last) dimension, to `length`."""
    return torch.nn.functional.pad(keys_or_values, (0, 0, 0, length - keys_or_values.shape[-2]))


def _recorded_keys_and_values(cache: _AppendingCache) -> tuple:
    if cache.keys is None:
        raise ValueError("stack_layers: the decoder layer called with a key/value cache did not "
                         "update it, so there are no keys and values to fill the cache with")
    # Detached: what the cache holds is read by later decoding steps, not differentiated.
    return cache.keys.detach(), cache.values.detach()


def layer_slice(stacked: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Slice `index` (a 0-d or 1-element tensor: the loop step's layer) of a stacked buffer."""
    return stacked.index_select(0, index.reshape(1))[0]


@functools.cache
def appended(parameter: str, padded_to: int | None = None) -> Recording:
    """The recording of each layer's new keys and values through its cache
    argument `parameter` (`past_key_values`; GPT-NeoX's `layer_past`), each
    layer reading those its cache holds (the scan's state), if any, and
    given them back followed by zeros up to `padded_to` (an empty
    StaticCache's length), if given."""
    return Recording(("appended keys and values", parameter, padded_to),
                     lambda index, state: {parameter: _AppendingCache(index, state, padded_to)},
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

    def get_seq_length(self, layer_idx=None):
        """How many positions the cache held before the call (StaticLayer's)."""
        return self.length

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
        return layer_slice(self.keys, self.index), layer_slice(self.values, self.index)


@functools.cache
def written_in_place(parameter: str) -> Recording:
    """Each layer's keys and values written into a StaticCache's stacked
    buffers, in place."""
    return Recording(("stacked static cache", parameter),
                     lambda index, state: {parameter: _StackedCacheWriter(index, state)},
                     lambda given: ())


@functools.cache
def keys_and_values_per_position(parameter: str, period: int) -> Recording:
    """The recording of the keys and values of each layer of a group of
    `period` layers, through their cache argument `parameter`."""
    return Recording(
        ("keys and values per position", parameter, period),
        lambda index, state: {"per_position": tuple({parameter: _AppendingCache()}
                                                    for _ in range(period))},
        lambda given: tuple(tensor for position in given["per_position"]
                            for tensor in _recorded_keys_and_values(position[parameter])))


class _RecordingEncoderDecoderCache(EncoderDecoderCache):
    """What each layer gets inside the scan in place of an empty
    EncoderDecoderCache (an encoder-decoder model's decoder: BART's,
    Whisper's): its self-attention and cross-attention caches record the keys
    and values the layer puts in (`_AppendingCache`); the cache gets them
    after the loop (`fill_encoder_decoder`)."""

    def __init__(self):  # not EncoderDecoderCache's, which takes two caches to hold
        self.self_attention_cache = _AppendingCache()
        self.cross_attention_cache = _AppendingCache()
        self.is_updated = _NoneComputedYet()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # it starts empty (T5's attention reads this before updating it)


class _NoneComputedYet:
    """The stand-in's `is_updated`: the cache starts empty, so no layer's
    cross-attention keys and values are computed yet, and what the layer marks
    is done after the loop (`fill_encoder_decoder`). It never looks at the
    layer's index, which inside the scan is the template's, not the layer's."""

    def get(self, layer_idx, default=None) -> bool:
        return False

    def __setitem__(self, layer_idx, computed: bool) -> None:
        pass


def _recorded_encoder_decoder(cache: _RecordingEncoderDecoderCache) -> tuple:
    """The self-attention keys and values, then the cross-attention ones if
    the layer computed them (it was given the encoder's hidden states)."""
    recorded = _recorded_keys_and_values(cache.self_attention_cache)
    if cache.cross_attention_cache.keys is None:
        return recorded
    return recorded + _recorded_keys_and_values(cache.cross_attention_cache)


@functools.cache
def appended_encoder_decoder(parameter: str) -> Recording:
    """The recording of each layer's new self-attention and cross-attention
    keys and values through its empty EncoderDecoderCache argument `parameter`."""
    return Recording(("appended encoder-decoder keys and values", parameter),
                     lambda index, state: {parameter: _RecordingEncoderDecoderCache()},
                     lambda given: _recorded_encoder_decoder(given[parameter]))


def fill_encoder_decoder(cache, recorded: tuple, first: int = 0) -> None:
    """Leaves an EncoderDecoderCache empty from layer `first` on as the
    layers' own updates would: each layer's self-attention keys and values,
    and its cross-attention ones (marked as computed, so that decoding steps
    read them) if recorded."""
    keys, values, *cross = recorded
    for index in range(keys.shape[0]):
        extend(cache.self_attention_cache, first + index, keys[index], values[index])
        if cross:
            extend(cache.cross_attention_cache, first + index, cross[0][index], cross[1][index])
            cache.is_updated[first + index] = True


def extend(cache, layer_index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """`cache.update(keys, values, layer_index)` for a DynamicCache, as the
    layer's own update would leave it, in a form XLA takes: a sliding-window
    layer that then holds fewer positions than its window keeps them all,
    where transformers slices them from before their start
    (`[..., -sliding_window + 1:, :]`), which CPU tensors clamp and XLA
    refuses ("Value out of range")."""
    layer = cache.layers[layer_index] if layer_index < len(cache.layers) else None
    if (layer is None or original_class(layer) is not DynamicSlidingWindowLayer
            or not keeps_all(layer, layer.get_seq_length() + keys.shape[-2])):
        cache.update(keys, values, layer_index)
        return
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    layer.cumulative_length += keys.shape[-2]
    layer.keys = torch.cat([layer.keys, keys], dim=-2)
    layer.values = torch.cat([layer.values, values], dim=-2)


def keeping_all(cache, new_tokens: int):
    """A copy of `cache` whose sliding-window layers that give back what a
    full-attention layer would on `new_tokens` more tokens (all a
    DynamicCache's; a StaticCache's while it holds what it holds and the new
    ones) are such layers, holding the same keys and values (its tensors
    shared, for a layer call traced on fakes of them): what a window keeps,
    and how, is left to the cache, as the scan's recordings leave it to the
    cache after the loop."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return cache
    copied = copy.copy(cache)
    copied.layers = [_keeping_all(layer, new_tokens) for layer in layers]
    return copied


def _keeping_all(layer, new_tokens: int):
    kind = original_class(layer)
    if kind is DynamicSlidingWindowLayer and not layer.record_past:
        full = DynamicLayer
    elif (kind is StaticSlidingWindowLayer
          and layer.cumulative_length_int + new_tokens <= layer.max_cache_len):
        full = StaticLayer
    else:
        return layer
    replaced = object.__new__(full)
    replaced.__dict__.update({name: value for name, value in vars(layer).items()
                              if not name.startswith("_stacked_")})
    if layer.is_initialized:  # a layer reading stacked buffers reads its slices
        replaced.keys, replaced.values = layer.keys, layer.values
    return replaced


def is_cache(value) -> bool:
    """A transformers key/value cache (`Cache`: DynamicCache, StaticCache, ...)."""
    return hasattr(value, "get_seq_length") and hasattr(value, "update")


def _stacked_slice(buffer: str, writes_through: bool) -> property:
    """A cache layer's `keys` or `values` as its slice of the stacked buffer,
    taken at each read. Assigning it writes the slice (`writes_through`: a
    StaticCache layer, which beam search's reordering assigns) or gives the
    layer its own tensors from then on (a DynamicCache layer, whose update,
    crop and reordering replace them with tensors of other shapes)."""
    stacked = "_stacked_" + buffer

    def read(layer) -> torch.Tensor:
        return getattr(layer, stacked)[layer._stacked_index]

    def write(layer, new: torch.Tensor) -> None:
        if writes_through:
            read(layer).copy_(new)
            return
        _leave_stacked_buffers(layer)
        setattr(layer, buffer, new)

    return property(read, write)


@functools.cache
def _reading_stacked_buffers(layer_class: type) -> type:
    """The class a cache layer takes once its cache is stacked: a subclass of
    the same name (what checks a cache layer's kind by name still sees it)
    whose keys and values are its slices of the stacked buffers. A view held
    by the layer would not do: torch_xla materializes every live view at a
    sync, which would keep a second copy of the cache."""
    writes_through = issubclass(layer_class, StaticLayer)
    return lookalike_subclass(layer_class, {
        "keys": _stacked_slice("keys", writes_through),
        "values": _stacked_slice("values", writes_through), "reads_stacked_buffers": True,
        "__reduce_ex__": _unbound_for_pickling, "__deepcopy__": _unbound_copy})


def _unbound_for_pickling(layer, protocol: int):
    """How a layer reading stacked buffers is pickled (and copied): as a layer
    of its transformers class holding its slices as its own tensors (pickle
    finds a class by its name, which the subclass shares)."""
    state = {name: value for name, value in vars(layer).items()
             if name not in ("_stacked_keys", "_stacked_values", "_stacked_index")}
    state["keys"], state["values"] = layer.keys, layer.values
    return reduce_as_original(layer, state)


def _unbound_copy(layer, memo: dict):
    """A deep copy of a layer reading stacked buffers, as a layer of its
    transformers class holding its slices of copies of the buffers (made
    through `memo`, as the copy of everything else it holds)."""
    state = {name: copy.deepcopy(value, memo) for name, value in vars(layer).items()
             if name not in ("_stacked_keys", "_stacked_values", "_stacked_index")}
    for name in ("keys", "values"):
        state[name] = copy.deepcopy(layer.__dict__[f"_stacked_{name}"], memo)[
            layer._stacked_index]
    copied = object.__new__(original_class(layer))
    copied.__dict__.update(state)
    memo[id(layer)] = copied
    return copied


def _leave_stacked_buffers(layer) -> None:
    """The layer takes its slices as its own tensors, and its class back."""
    keys, values = layer.keys, layer.values
    swap_back(layer)
    for name in ("_stacked_keys", "_stacked_values", "_stacked_index"):
        del layer.__dict__[name]
    layer.keys, layer.values = keys, values


def advance(layers: list, new_tokens: int) -> None:
    """Counts `new_tokens` more in each of the StaticCache `layers` written in
    place, as their own updates would have."""
    for layer in layers:
        layer.cumulative_length.add_(new_tokens)
        if layer.is_sliding:  # which also counts on the host
            layer.cumulative_length_int += new_tokens


def _bind_stacked(layers: list, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Makes each of the cache `layers`' tensors its slices of `keys`/`values`."""
    for index, layer in enumerate(layers):
        # Its own tensors go: the slices replace them.
        layer.__dict__.pop("keys", None)
        layer.__dict__.pop("values", None)
        if not getattr(layer, "reads_stacked_buffers", False):  # else it reads new ones
            swap_in(layer, _reading_stacked_buffers(type(layer)))
        layer._stacked_keys, layer._stacked_values, layer._stacked_index = keys, values, index


def fill_stacked(layers: list, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Fills the empty StaticCache `layers` with a prefill's stacked keys and
    values [layers, batch, heads, length, head_dim], their buffers stacked."""
    for index, layer in enumerate(layers):
        layer.lazy_initialization(keys[index], values[index])  # shapes; its zeros stay unmade
    length = keys.shape[-2]
    _bind_stacked(layers, *(_padded(new.to(layer_tensor.dtype), layer_tensor.shape[-2])
                            for new, layer_tensor in ((keys, layers[0].keys),
                                                      (values, layers[0].values))))
    advance(layers, length)


def stacked_buffers(layers: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The filled cache `layers`' stacked key and value buffers. Stacks their
    tensors first (one copy) when they are not slices of the same ones (the
    cache was filled layer by layer, or its layers are stacked otherwise)."""
    if not reads_one_stack(layers):
        _bind_stacked(layers, torch.stack([layer.keys for layer in layers]),
                      torch.stack([layer.values for layer in layers]))
    return layers[0]._stacked_keys, layers[0]._stacked_values


def keeps_all(layer, length: int) -> bool:
    """Whether a DynamicCache layer that receives `length` positions in all
    keeps every one (a sliding window keeps its last `sliding_window - 1`)."""
    return not layer.is_sliding or (not layer.record_past and length < layer.sliding_window)


def reads_one_stack(layers) -> bool:
    """Whether the layers read their slices of the same stacked buffers, in order
    and all of them."""
    stacked = layers[0].__dict__.get("_stacked_keys")
    return (stacked is not None and stacked.shape[0] == len(layers)
            and all(layer.__dict__.get("_stacked_keys") is stacked
                    and layer.__dict__.get("_stacked_index") == index
                    for index, layer in enumerate(layers)))


def hold_stacked(layers: list, keys: torch.Tensor, values: torch.Tensor, new_tokens: int) -> None:
    """Makes DynamicCache `layers` (one per decoder layer of a scan, each
    keeping all it receives) read their slices of `keys`/`values` [layers,
    batch, heads, length, head_dim], as their own updates would have left
    them had they been given the last `new_tokens` positions: no per-layer
    tensor, so a decoding step reads them as they are, without stacking
    them again."""
    for index, layer in enumerate(layers):
        if not layer.is_initialized:
            layer.lazy_initialization(keys[index], values[index])
        if layer.is_sliding:  # which counts what it was given
            layer.cumulative_length += new_tokens
    _bind_stacked(layers, keys, values)
