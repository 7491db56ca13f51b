"""Key/value caches of any kind of cache layer, starting empty, around a scan.

A cache whose layers a scan covers may hold layers of kinds the other plans
do not know (linear attention's convolution and recurrent states, an
indexer's keys: hybrid and sparse-attention models). While they hold
nothing yet (training with the default `use_cache=True`, a prompt's
prefill), one scan stands for the layers all the same: each step gets a
stand-in of the cache whose every layer is one fresh copy of the empty
cache layer the step's layer would get (`fresh_layers`), which the layer
fills through the cache's own methods, as it would fill its own; the
tensors it leaves in the copy are stacked along the layers, and after the
loop each of the cache's layers takes its slice of them, with the rest of
the state the copy took (flags, sizes: the same for every layer of the
scan, found when the step was traced) (`fill_fresh`).

The stand-in answers a layer's index with the one fresh layer (which layer
it is, inside a scan, is no value the trace may read), and a call asking how
much it holds with nothing (it starts empty).
"""
from __future__ import annotations

import copy
import functools
import threading

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from torch_xla_ext.class_swaps import lookalike_subclass
from torch_xla_ext.layer_stack import Recording

__all__ = ["fill_fresh", "fresh_layers", "holds_no_tensors"]

# Per recording's key and position: the spec of the state a fresh layer is
# left with, and its leaves, each a tensor's stand-in (`_TENSOR`) or itself,
# found when the step was traced.
_STATES: dict = {}
_TENSOR = object()
_LOCK = threading.Lock()


def holds_no_tensors(layer) -> bool:
    """Whether a cache layer holds no tensor yet (made empty, filled lazily)."""
    return not any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(vars(layer))[0])


class _SameLayer:
    """The stand-in's `layers`: any index is the one fresh layer."""

    def __init__(self, layer, count: int):
        self.layer, self.count = layer, count

    def __getitem__(self, index):
        return self.layer

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return iter([self.layer] * self.count)


def _update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
    return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)


def _get_seq_length(self, layer_idx=0) -> int:
    return 0  # the cache starts empty


@functools.cache
def _stand_in_class(cache_class: type) -> type:
    return lookalike_subclass(cache_class, {"update": _update, "get_seq_length": _get_seq_length})


def _stand_in(cache, layer):
    """A cache like `cache` whose every layer is `layer`."""
    stand_in = object.__new__(_stand_in_class(type(cache)))
    stand_in.__dict__.update(vars(cache))
    stand_in.layers = _SameLayer(layer, len(cache.layers))
    return stand_in


def fresh_layers(cache, parameter: str, first: int, period: int | None) -> Recording:
    """What each step of a scan over the cache's layers `first`, ... gets as
    its cache argument `parameter` (a group of `period` layers: one stand-in
    per position, by `per_position`), and the tensors it records."""
    positions = 1 if period is None else period
    templates = [copy.deepcopy(cache.layers[first + position]) for position in range(positions)]
    key = ("fresh cache layers", parameter, type(cache), period,
           tuple(type(template) for template in templates))

    def make(index, *state):
        stand_ins = [{parameter: _stand_in(cache, copy.deepcopy(template))}
                     for template in templates]
        return stand_ins[0] if period is None else {"per_position": tuple(stand_ins)}

    def recorded(given) -> tuple:
        stand_ins = [given] if period is None else given["per_position"]
        found = []
        for position, each in enumerate(stand_ins):
            leaves, spec = tree_flatten(vars(each[parameter].layers.layer))
            with _LOCK:
                _STATES[key, position] = (spec, [_TENSOR if isinstance(leaf, torch.Tensor)
                                                 else leaf for leaf in leaves])
            # Detached: what the cache holds is read by later calls, not differentiated.
            found.append(tuple(leaf.detach() for leaf in leaves if isinstance(leaf, torch.Tensor)))
        return tuple(found)

    return Recording(key, make, recorded)


def fill_fresh(cache, recording: Recording, recorded: tuple, first: int,
               period: int | None) -> None:
    """Gives each of the cache's layers from `first` on the state its fresh
    layer was left with in the scan: its slice of each recorded tensor."""
    positions = 1 if period is None else period
    groups = recorded[0][0].shape[0] if recorded[0] else 0
    for group in range(groups):
        for position in range(positions):
            spec, leaves = _STATES[recording.key, position]
            tensors = iter(stacked[group] for stacked in recorded[position])
            state = tree_unflatten([next(tensors) if leaf is _TENSOR else leaf
                                    for leaf in leaves], spec)
            cache.layers[first + group * positions + position].__dict__.update(state)
