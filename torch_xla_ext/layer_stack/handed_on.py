"""What a layer returns besides the hidden state, as the arguments it got.

A model's loop may hand values that a layer returns back as arguments of the
next layer's call (T5's position biases: `hidden, bias = layer(hidden, mask,
bias)`, then `bias = ...`). One scan gives every layer the same arguments,
so it stands for such a loop only where each layer returns, besides the
hidden state, the very arguments it got (or constants such as None): the
values handed on then never change, and every layer, the last one too,
returns them. `handed_on` finds that out by calling the layer once on fake
tensors (no data, nothing computed), per form of the call.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

from torch_xla_ext.layer_stack.alike import layout_of
from torch_xla_ext.layer_stack.hooks import hooks_held
from torch_xla_ext.layer_stack.kinds import argument_path
from torch_xla_ext.object_graph import VALUE_TYPES

__all__ = ["Constant", "handed_on", "returned"]


@dataclasses.dataclass(frozen=True)
class Constant:
    """A returned value that is no argument (None, a flag, ...)."""
    value: object


# Per layer, per form of the call: what `handed_on` found.
_FOUND: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def handed_on(layer: nn.Module, weights: dict[str, torch.Tensor], hidden, args: tuple,
              kwargs: dict) -> tuple | None | str:
    """Each value that `layer(hidden, *args, **kwargs)`, run on one slice of
    the stacked `weights` ([num_layers, ...] by name), returns after the
    hidden state: the index of the argument it is, among the leaves of
    `tree_flatten((args, kwargs))`, or a `Constant`; None when it returns
    the hidden state alone, not in a tuple. Or why not: a value the layer
    computes, or an argument no fake can stand for (a key/value cache,
    which the call would update)."""
    leaves, spec = tree_flatten((args, kwargs))
    for path, leaf in tree_flatten_with_path((args, kwargs))[0]:
        if not isinstance(leaf, (torch.Tensor, *VALUE_TYPES)):
            return (f"argument {argument_path(path)} is a {type(leaf).__name__}, which the "
                    f"layers would change as they run, and layers that hand values on to the "
                    f"next layer's call run as one scan only on tensors and constants (a "
                    f"transformers model without a key/value cache: use_cache=False)")
    key = (layout_of(layer, 0).trace_key(), str(spec), tuple(
        (tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor)
        else (type(leaf), leaf) for leaf in (hidden, *leaves)))
    found = _FOUND.setdefault(layer, {})
    if key not in found:
        found[key] = _traced(layer, weights, hidden, leaves, spec)
    return found[key]


def returned(found: tuple | None, hidden, args: tuple, kwargs: dict):
    """What the layers return after a call with `args` and `kwargs` that
    gave the hidden state `hidden`, as `handed_on` found it."""
    if found is None:
        return hidden
    leaves = tree_flatten((args, kwargs))[0]
    return (hidden, *(each.value if isinstance(each, Constant) else leaves[each]
                      for each in found))


def _traced(layer: nn.Module, weights: dict, hidden, leaves: list, spec) -> tuple | None | str:
    mode = FakeTensorMode()

    def fake(tensor, shape=None):
        if not isinstance(tensor, torch.Tensor):
            return tensor
        with mode:
            # On the CPU, as layers make their constants.
            return torch.empty(tensor.shape if shape is None else shape, dtype=tensor.dtype)

    fakes = [fake(leaf) for leaf in leaves]
    args, kwargs = tree_unflatten(fakes, spec)
    # The layer's forward hooks would see the fakes (a stack replays them after its loop).
    with mode, torch.no_grad(), hooks_held(layer):
        output = torch.func.functional_call(
            layer, {name: fake(tensor, tensor.shape[1:]) for name, tensor in weights.items()},
            (tree_map(fake, hidden), *args), kwargs)
    if not isinstance(output, tuple):
        return None
    found = []
    for position, value in enumerate(output[1:], start=1):
        index = next((index for index, leaf in enumerate(fakes) if leaf is value), None)
        if index is not None:
            found.append(index)
        elif isinstance(value, VALUE_TYPES):
            found.append(Constant(value))
        else:
            what = "tensor" if isinstance(value, torch.Tensor) else type(value).__name__
            return (f"the layer returns a {what} it computes as its value "
                    f"{position} (after the hidden state), which the model's loop hands on "
                    f"to the next layer's call, and one scan gives every layer the same "
                    f"arguments")
    return tuple(found)

