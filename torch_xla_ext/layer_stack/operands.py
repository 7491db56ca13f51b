"""A layer call's arguments as a scan's operands, and back inside its step.

A scan step traced once stands for every layer, so what a call passes the
layers is split (`split_arguments`): tensors ride the carry unchanged; a
PerLayerChoice's variants ride stacked, and each step picks its layer's; a
HandedOn value rides the carry, each layer's output giving the next its
own; the leaf where each layer gets its own index (`LAYER_INDEX`) is the
step's opaque index, which the layer may hand on but not use
(`per_layer`); a shared mapping's entries ride as tensors, and the step hands the
layer the very mapping, filled with the traced entries (`traced_with`);
plain constants are part of the step's key. Anything else cannot enter a
traced loop (`Unscannable`, with the argument's path). Inside the step,
`leaves_in_step` puts the call's leaves together again."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from torch_xla_ext.diagnostics import Refusal
from torch_xla_ext.layer_stack.kinds import PerLayerChoice, argument_path
from torch_xla_ext.layer_stack.shared_mappings import gathered, is_shared_mapping
from torch_xla_ext.object_graph import VALUE_TYPES

__all__ = ["LAYER_INDEX", "HandedOn", "Unscannable", "choice_tensor", "leaves_in_step",
           "split_arguments", "traced_with"]


class Unscannable(Exception):
    """Why a call cannot run as one scan, found while its step is traced:
    what takes the trace out of the scan, to the runner that returns its
    `refusal`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.refusal = Refusal(reason)


@dataclasses.dataclass(frozen=True)
class HandedOn:
    """A leaf of a scan's call arguments that each layer gets from the layer
    before it, besides the hidden state: `value` is the first layer's, and
    each later layer gets leaf `output` of the previous layer's output (its
    `tree_flatten` leaves). The scan carries it with the hidden state, and
    gives back the last layer's."""
    value: torch.Tensor
    output: int


class _LayerIndex:
    def __repr__(self):
        return "<each layer's own index>"


# A leaf of a scan's call arguments where each layer gets its own index in its list.
LAYER_INDEX = _LayerIndex()

# Stand in the call key for a tensor argument, which is passed through the
# carry, and for a PerLayerChoice, whose variants are (stacked).
_TENSOR_ARGUMENT = object()
_CHOSEN_ARGUMENT = object()
# Stands in the call key for a shared mapping, followed by its entries' leaves.
_SHARED_MAPPING = object()


class _MappingsTraced(threading.local):
    """This thread's shared mappings of the calls whose scan steps are being
    traced, innermost last (the step holds no mapping: a new one at every
    forward would make it trace anew)."""

    def __init__(self):
        self.stack: list = []


_MAPPINGS_TRACED = _MappingsTraced()


@dataclasses.dataclass(frozen=True)
class _HandedLeaf:
    """Stands in the call key for a HandedOn argument: the carry gives it,
    from leaf `output` of the previous layer's output."""
    output: int


def split_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple, list, list]:
    """Splits layer call arguments into tensors (a PerLayerChoice's variants
    stacked), the HandedOn arguments' first values (by the output leaf that
    the next layer gets them from), a hashable description of the rest, the
    PerLayerChoices' per-layer choices and the shared mappings
    (`shared_mappings`), whose entries' leaves follow each mapping's
    description; raises Unscannable for an argument that is none of these."""
    leaves, spec = tree_flatten((args, kwargs))
    paths = None
    tensors, handed, constants, choices, mappings = [], {}, [], [], []
    pending = [(leaf, None) for leaf in reversed(leaves)]
    while pending:
        leaf, entry_path = pending.pop()
        if isinstance(leaf, HandedOn) and entry_path is None:
            handed.setdefault(leaf.output, leaf.value)
            constants.append(_HandedLeaf(leaf.output))
        elif leaf is LAYER_INDEX:
            constants.append(LAYER_INDEX)
        elif isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            constants.append(_TENSOR_ARGUMENT)
        elif isinstance(leaf, PerLayerChoice) and entry_path is None:
            tensors.append(_stacked_variants(leaf, args, kwargs))
            constants.append(_CHOSEN_ARGUMENT)
            choices.append(leaf.choice)
        elif isinstance(leaf, VALUE_TYPES):
            # With its type, since True == 1 == 1.0 would otherwise share one trace.
            constants.append((type(leaf), leaf))
        elif is_shared_mapping(leaf) and entry_path is None:
            paths = paths or tree_flatten_with_path((args, kwargs))[0]
            path = argument_path(next(path for path, value in paths if value is leaf))
            entries, entries_spec = tree_flatten_with_path(dict(leaf.items()))
            mappings.append((leaf, path))
            constants.append((_SHARED_MAPPING, len(entries), entries_spec))
            pending += [(value, path + keystr(key)) for key, value in reversed(entries)]
        else:
            paths = paths or tree_flatten_with_path((args, kwargs))[0]
            path = entry_path or argument_path(next(path for path, value in paths
                                                    if value is leaf))
            raise Unscannable(
                f"argument {path} is of type {type(leaf).__name__}, and only tensors and plain "
                f"constants (None, bool, int, float, str), or mappings of them that every "
                f"layer gets, can enter a traced loop")
    return tuple(tensors), handed, (spec, tuple(constants)), choices, mappings


def _stacked_variants(choice, args: tuple, kwargs: dict) -> torch.Tensor:
    """A PerLayerChoice's variants as one tensor; raises Unscannable unless
    they are tensors of one shape, dtype and device."""
    variants = choice.variants
    if all(isinstance(each, torch.Tensor) for each in variants) and len(
            {(each.shape, each.dtype, each.device) for each in variants}) == 1:
        return torch.stack(variants)
    path = next(path for path, value in tree_flatten_with_path((args, kwargs))[0]
                if value is choice)
    described = ", ".join(f"{tuple(each.shape)} {each.dtype}" if isinstance(each, torch.Tensor)
                          else type(each).__name__ for each in variants)
    raise Unscannable(f"argument {argument_path(path)} differs between the layers' kinds "
                      f"({described}), and a scan step picks only among tensors of one shape "
                      f"and dtype")


def leaves_in_step(constants: tuple, tensor_arguments: tuple, handed: dict, picks,
                   index) -> tuple:
    """Inside a scan step, the leaves of a layer call's arguments again, from
    the description `split_arguments` made (its `constants`), the tensors
    the carry gives, the HandedOn values, each PerLayerChoice's pick and the
    layer's `index` where it gets its own;
    with the shared mappings of the call being traced, filled with their
    traced entries (`shared_mappings.gathered`)."""
    supplied, picks = iter(tensor_arguments), iter(picks)
    values = [next(supplied) if constant is _TENSOR_ARGUMENT
              else torch.index_select(next(supplied), 0, next(picks).view(1))[0]
              if constant is _CHOSEN_ARGUMENT
              else handed[constant.output] if isinstance(constant, _HandedLeaf)
              else index if constant is LAYER_INDEX
              else constant if constant[0] is _SHARED_MAPPING else constant[1]
              for constant in constants]
    return gathered(values, _SHARED_MAPPING, _MAPPINGS_TRACED.stack[-1])


@functools.lru_cache(maxsize=64)
def choice_tensor(choice: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Each layer's variant index on the device, uploaded once, not at every call."""
    return torch.tensor(choice, device=device)


@contextlib.contextmanager
def traced_with(mappings: list):
    """The shared mappings of the call whose step a scan may trace meanwhile."""
    _MAPPINGS_TRACED.stack.append(mappings)
    try:
        yield
    finally:
        _MAPPINGS_TRACED.stack.pop()
