"""Key/value caches of any kind, starting empty, around a scan.

A cache whose layers a scan covers may hold cache layers of kinds the other
plans do not know (linear attention's convolution and recurrent states, an
indexer's keys: hybrid and sparse-attention models), or keep per-layer
state of its own besides its `layers`: lists (or dicts keyed by layer
index) that its methods read and write at the layer index they are given
(`side_lists`: a linear-attention layer's matrix, say). While what the scan's layers would fill holds nothing
yet (training with the default `use_cache=True`, a prompt's prefill), one
scan stands for the layers all the same.

Each step gets a one-layer cache: an instance of the cache's own class (of a
look-alike subclass) holding, at slot 0 of its `layers` and of its side
lists, a fresh copy of what the cache holds at the step's layer's slot (or
nothing, where the cache adds the slot when a layer first writes it). Its
methods, given the layer's index (inside a scan an `OpaqueValue`, which no
trace may read), act at slot 0, so the layer fills it through the cache's
own code, as it would fill its own slot. Afterwards (`fill_fresh`), in the
layers' order:

* the calls that changed a side list are made again on the cache itself,
  with the layer's index and its slices of their tensor arguments, so that
  the cache's own code puts them (and whatever it pads the list with) where
  the layer would have;
* the cache layer at the layer's slot (added as the cache adds one, if the
  layer added it) takes the state the step left in slot 0: its slice of each
  tensor, with the rest of the state (flags, sizes: the same for every layer
  of the scan, found when the step was traced).

A group of layers (a pattern's scan) gets a one-layer cache per position,
each with the state its position leaves.

A cache whose layers hold state (a decoding step of a hybrid model: Mamba's
convolution and recurrent states, attention's keys and values) is the same
case, where each position's cache layers are alike (`holds_alike_states`:
one class, tensors of one shape and dtype, the same flags and sizes): their
tensors, stacked along the layers (`held_states`), are the scan's state, and
each step's one-layer cache holds its layer's slices of them, which the
layer's update reads and replaces as it would its own.

What the one-layer cache cannot stand for: a side list the layer indexes
itself with its index (not through the cache's methods) makes the trace
read the index, so the layers run one by one; a layer that changes other
attributes of the cache (a count of its own) makes the call raise a
ValueError saying which, rather than leave the cache without them.
"""
from __future__ import annotations

import copy
import functools
import inspect

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from torch_xla_ext.class_swaps import lookalike_subclass, original_class
from torch_xla_ext.hf.caches import layer_slice
from torch_xla_ext.layer_stack import OpaqueValue, Recording

__all__ = ["fill_fresh", "fresh_layers", "held_states", "holds_alike_states", "side_lists",
           "starts_empty_from"]

# In what a step left (`_left_in`), a tensor's place and the layer's index.
_TENSOR = object()
_INDEX = object()
# The one-layer cache's record of the calls that changed its side lists.
_WRITES = "_side_list_writes"


def side_lists(cache) -> tuple[str, ...]:
    """The names of the lists (or dicts keyed by layer index) a cache keeps
    besides its `layers`: per-layer state its methods read and write by the
    layer's index."""
    return tuple(name for name, value in vars(cache).items() if name != "layers" and (
        isinstance(value, list)
        or isinstance(value, dict) and all(type(key) is int for key in value)))


def _slots(side: list | dict) -> dict:
    """A side list's (or dict's) slots by layer index."""
    return dict(enumerate(side)) if isinstance(side, list) else side


def _leaves(value) -> list:
    """The leaves of what a slot holds: an object's attributes, or itself."""
    plain = isinstance(value, (torch.Tensor, list, tuple, dict)) or not hasattr(value, "__dict__")
    return tree_flatten(value if plain else vars(value))[0]


def _holds_no_states(value) -> bool:
    """Whether a cache layer (or a side list's slot) holds no state of any
    token yet: no tensor but 0-dimensional ones (settings, such as a sliding
    window's size). Whether it says it is initialized does not count: a
    layer that stores nothing (transformers' `DummyLayer`, the slot of a
    layer that reuses another's keys and values) says it is."""
    return all(leaf.dim() == 0 for leaf in _leaves(value) if isinstance(leaf, torch.Tensor))


def starts_empty_from(cache, first: int, count: int, period: int | None) -> bool:
    """Whether the layers `first`, ..., `first + count - 1` of `cache` find
    nothing in their slots (so a fresh one-layer cache stands for each):
    its cache layers there hold no state, alike at each position of a group
    (`period` layers; one kind of cache layer per position), and where some
    are yet to be added, they are those the cache adds; its side lists hold
    no state from slot `first` on, and have every slot of the layers, or
    none."""
    layers = getattr(cache, "layers", None)
    stop = first + count
    if not isinstance(layers, list) or getattr(cache, "offloading", False):
        return False
    present = layers[first:stop]
    positions = period or 1
    if not all(_holds_no_states(layer) for layer in present) or any(
            type(layer) is not type(present[index % positions])
            for index, layer in enumerate(present)):
        return False
    added = getattr(cache, "layer_class_to_replicate", None)
    if len(present) < count and (added is None or any(
            original_class(layer) is not added for layer in present)):
        return False
    for name in side_lists(cache):
        held = {index: slot for index, slot in _slots(vars(cache)[name]).items() if index >= first}
        if held and not (set(range(first, stop)) <= held.keys()
                         and all(map(_holds_no_states, held.values()))):
            return False
    return True


def holds_alike_states(cache, first: int, count: int, period: int | None) -> bool:
    """Whether the cache layers of layers `first`, ..., `first + count - 1`
    hold state, alike at each position of a group (`period` layers): of one
    class, with tensors of one shape, dtype and device at the same places and
    the same other values (flags, sizes), so that one trace stands for each
    position and its tensors stack along the layers; and the cache keeps no
    side lists, whose slots only its own methods know how to fill."""
    layers = getattr(cache, "layers", None)
    if (not isinstance(layers, list) or len(layers) < first + count
            or getattr(cache, "offloading", False) or side_lists(cache)):
        return False
    present = layers[first:first + count]
    if all(_holds_no_states(layer) for layer in present):
        return False
    positions = period or 1
    return all(_state_form(layer) == _state_form(present[index % positions])
               for index, layer in enumerate(present))


def _state_form(layer) -> tuple:
    """A cache layer's class, the form of its attributes, and their leaves
    (a tensor by its shape, dtype and device)."""
    leaves, spec = tree_flatten(vars(layer))
    return original_class(layer), spec, [
        (tuple(leaf.shape), leaf.dtype, leaf.device) if isinstance(leaf, torch.Tensor) else leaf
        for leaf in leaves]


def _tensors_of(layer) -> list:
    return [leaf for leaf in _leaves(layer) if isinstance(leaf, torch.Tensor)]


def held_states(cache, first: int, count: int, period: int | None) -> tuple:
    """The tensors of the cache layers of layers `first`, ..., `first + count
    - 1`, each stacked along its position's layers (`[groups, ...]`), by
    position: the scan's state (see `holds_alike_states`)."""
    positions = period or 1
    present = cache.layers[first:first + count]
    return tuple(torch.stack(per_layer) for position in range(positions)
                 for per_layer in zip(*map(_tensors_of, present[position::positions])))


def _holding(one, slices: list) -> None:
    """Gives the one-layer cache `one`'s layer the tensors `slices`, in the
    order of its own."""
    layer = one.layers[0]
    leaves, spec = tree_flatten(vars(layer))
    given = iter(slices)
    layer.__dict__.update(tree_unflatten(
        [next(given) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec))


class _SlotZero(list):
    """The one-layer cache's `layers`: a layer's index (`OpaqueValue`) is slot 0."""

    def __getitem__(self, index):
        return super().__getitem__(0 if isinstance(index, OpaqueValue) else index)

    def __setitem__(self, index, value):
        super().__setitem__(0 if isinstance(index, OpaqueValue) else index, value)


def _side_lists_now(cache) -> tuple:
    """What the side lists are now, by identity (a call that changes one
    replaces a slot, or the list)."""
    return tuple((id(side), tuple((index, id(slot)) for index, slot in _slots(side).items()))
                 for side in (vars(cache)[name] for name in side_lists(cache)))


def _redirected(name: str, method):
    """`method` of the one-layer cache: a layer's index among its arguments is
    slot 0; a call that changes a side list (other than one made inside
    another of its methods) is recorded, to be made again on the cache."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        writes = self.__dict__.pop(_WRITES, None)  # absent while a call runs
        if writes is None:
            return method(self, *args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        slot_zero, slot_zero_kwargs = tree_unflatten(
            [0 if isinstance(leaf, OpaqueValue) else leaf for leaf in leaves], spec)
        before = _side_lists_now(self)
        try:
            return method(self, *slot_zero, **slot_zero_kwargs)
        finally:
            if _side_lists_now(self) != before:
                writes.append((name, (args, kwargs)))
            self.__dict__[_WRITES] = writes

    return call


@functools.cache
def _one_layer_class(cache_class: type) -> type:
    """A look-alike subclass of `cache_class` whose methods act at slot 0 for a
    layer's index (`_redirected`)."""
    methods = {name: _redirected(name, value) for name in dir(cache_class)
               if not name.startswith("__")
               and inspect.isfunction(value := inspect.getattr_static(cache_class, name))}
    return lookalike_subclass(cache_class, methods)


def _fresh_copy(value):
    """A deep copy of what a slot holds, sharing its tensors (settings, such as a
    window's size: copied inside a trace, they would be the trace's)."""
    return copy.deepcopy(value, {id(leaf): leaf for leaf in _leaves(value)
                                 if isinstance(leaf, torch.Tensor)})


def _one_layer(cache, layer_template, side_templates: dict):
    """A cache like `cache` holding `layer_template` (a fresh copy; or no
    layer, if None) and each side list's template slot at slot 0."""
    one = object.__new__(_one_layer_class(original_class(cache)))
    one.__dict__.update(vars(cache))
    one.layers = _SlotZero([] if layer_template is None else [_fresh_copy(layer_template)])
    for name, template in side_templates.items():
        slot_zero = [] if template is None else [_fresh_copy(template[0])]
        setattr(one, name, slot_zero if isinstance(vars(cache)[name], list)
                else dict(enumerate(slot_zero)))
    one.__dict__[_WRITES] = []
    return one


def _check_nothing_else_changed(cache, one) -> None:
    """Raises if the step's layer changed an attribute of its one-layer cache
    other than its layers and side lists, which the cache would not get."""
    kept = {"layers", _WRITES, *side_lists(cache)}
    changed = [name for name, value in vars(one).items() if name not in kept
               and (name not in vars(cache) or vars(cache)[name] is not value)]
    if changed:
        raise ValueError(
            f"stack_layers: the decoder layer changed the key/value cache's attributes "
            f"{changed}, which hold no per-layer state a scan can give back to the cache; "
            f"pass use_cache=False, or unstack the layers (unstack_layers) for this call")


def _left_in(one) -> tuple[list, tuple | None, list]:
    """What a step left in its one-layer cache `one`: the calls that changed
    a side list (method name, spec and leaves of their arguments, each tensor
    `_TENSOR`, the layer's index `_INDEX`), the slot-0 cache layer's state
    (its spec and leaves, marked alike) or None if it has none, and the
    tensors of both, in that order."""
    writes, tensors = [], []
    for name, arguments in one.__dict__[_WRITES]:
        leaves, spec = tree_flatten(arguments)
        writes.append((name, spec, _marked(leaves)))
        tensors += [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    layer_state = None
    if len(one.layers):
        leaves, spec = tree_flatten(vars(one.layers[0]))
        layer_state = (spec, _marked(leaves))
        tensors += [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    return writes, layer_state, tensors


def _marked(leaves: list) -> list:
    return [_TENSOR if isinstance(leaf, torch.Tensor) else _INDEX
            if isinstance(leaf, OpaqueValue) else leaf for leaf in leaves]


def fresh_layers(cache, parameter: str, first: int, period: int | None,
                 held: bool = False) -> Recording:
    """What each step of a scan over the cache's layers `first`, ... gets as
    its cache argument `parameter` (a group of `period` layers: one per
    position, by `per_position`), the tensors it records (the calls'
    that changed a side list, then those the slot-0 cache layer holds), and
    what else the step left, found when it is traced (`Recording.found`).
    `held`: the cache layers hold state, the scan's (`held_states`), whose
    slices each step's cache layer holds."""
    positions = range(1 if period is None else period)
    templates = [_fresh_copy(cache.layers[first + position])
                 if first + position < len(cache.layers) else None for position in positions]
    sides = [{name: (_slots(vars(cache)[name])[first + position],)
              if first + position in _slots(vars(cache)[name]) else None
              for name in side_lists(cache)} for position in positions]
    key = ("fresh one-layer caches", parameter, original_class(cache), period, held,
           tuple(type(template) for template in templates),
           tuple(tuple(template is None for template in side.values()) for side in sides))
    held_counts = [len(_tensors_of(template)) if held else 0 for template in templates]

    def make(index, state=()):
        stand_ins = []
        for template, side, count in zip(templates, sides, held_counts):
            one = _one_layer(cache, template, side)
            if count:
                _holding(one, [layer_slice(stacked, index) for stacked in state[:count]])
                state = state[count:]
            stand_ins.append({parameter: one})
        return stand_ins[0] if period is None else {"per_position": tuple(stand_ins)}

    def one_layer_caches(given) -> list:
        return [each[parameter] for each in ([given] if period is None
                                             else given["per_position"])]

    def recorded(given) -> tuple:
        tensors = []
        for one in one_layer_caches(given):
            _check_nothing_else_changed(cache, one)
            # Detached: what the cache holds is read by later calls, not differentiated.
            tensors.append(tuple(tensor.detach() for tensor in _left_in(one)[2]))
        return tuple(tensors)

    def found(given) -> tuple:
        return tuple(_left_in(one)[:2] for one in one_layer_caches(given))

    return Recording(key, make, recorded, found)


def fill_fresh(cache, found: tuple, recorded: tuple, first: int, count: int,
               period: int | None) -> None:
    """Leaves the cache's slots `first`, ..., `first + count - 1` as the
    layers' own calls would have: each layer's side-list writes made again,
    and its cache layer given the state its step left, as the step's trace
    found them (`found`, by position: `Recording.found`; see the module
    docstring)."""
    positions = 1 if period is None else period
    for group in range(count // positions):
        for position in range(positions):
            index = first + group * positions + position
            writes, layer_state = found[position]
            tensors = iter(stacked[group] for stacked in recorded[position])

            def filled(leaves: list) -> list:
                return [next(tensors) if leaf is _TENSOR else index if leaf is _INDEX else leaf
                        for leaf in leaves]

            for name, spec, leaves in writes:
                args, kwargs = tree_unflatten(filled(leaves), spec)
                getattr(cache, name)(*args, **kwargs)
            if layer_state is not None:
                spec, leaves = layer_state
                while len(cache.layers) <= index:  # as the cache adds a layer's slot
                    cache.layers.append(cache.layer_class_to_replicate())
                cache.layers[index].__dict__.update(tree_unflatten(filled(leaves), spec))
