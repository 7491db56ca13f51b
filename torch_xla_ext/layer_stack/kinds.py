"""Layers of several kinds as one scan: layers that differ only in settings
that pick what the model's loop hands each kind (Gemma's sliding and full
attention get their kind's mask and rotary table) run one layer's code for
every layer, each given its kind's arguments.

* `PerLayerChoice`: an argument that differs between the layers' calls;
  the scan takes each variant once (stacked) and each layer picks its own
  inside the loop (`call_for_layer` gives a layer its call, outside it);
* `program_of`: one trace stands for every kind only if the layer
  computes the same with each kind's settings. Each kind's layer is traced
  by `make_fx` on fakes (no data, `fakes`) and the graphs and their
  constants compared: a setting that only reaches code that ignores it
  (transformers' eager and SDPA attention take `sliding_window` and drop it)
  changes nothing. The trace also records the Python numbers of the layer's
  arithmetic, and can take some of them as inputs (`lifted_numbers`).
"""
from __future__ import annotations

import dataclasses
import operator


import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import keystr, tree_map, tree_unflatten

from torch_xla_ext.layer_stack.fakes import fake_leaves, fake_mode, fake_weights, faking
from torch_xla_ext.layer_stack.hooks import hooks_held
from torch_xla_ext.layer_stack.lifted_numbers import LiftedNumbers, Number, Numbers
from torch_xla_ext.layer_stack.shared_mappings import is_shared_mapping
from torch_xla_ext.object_graph import VALUE_TYPES

__all__ = ["PerLayerChoice", "call_for_layer", "hidden_of", "program_of", "same_leaf"]


@dataclasses.dataclass(frozen=True)
class PerLayerChoice:
    """An argument that differs between the layers of a stack: layer i gets
    `variants[choice[i]]`. As a leaf of a stack's call arguments, its
    variants enter the scan once (stacked, when they are tensors of one
    shape and dtype) and each step picks its layer's."""
    variants: tuple
    choice: tuple[int, ...]

    def for_layer(self, index: int):
        return self.variants[self.choice[index]]


def for_layer(tree, index: int):
    """`tree` with each PerLayerChoice replaced by layer `index`'s variant."""
    return tree_map(lambda leaf: leaf.for_layer(index) if isinstance(leaf, PerLayerChoice) else leaf, tree)


def call_for_layer(args: tuple, kwargs: dict, index: int) -> tuple[tuple, dict]:
    """Layer `index`'s call: its variant of each PerLayerChoice."""
    return for_layer((args, kwargs), index)


def argument_path(path) -> str:
    """'args[1]' or "kwargs['mask']" for a leaf path of the pytree `(args, kwargs)`."""
    return ("args" if path[0].idx == 0 else "kwargs") + keystr(path[1:])


def hidden_of(output):
    """The hidden state a layer returned: its output, or the first item of
    the tuple or list it returned (transformers' layers return either)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def same_leaf(leaf, reference) -> bool:
    """The same object, or an equal plain constant of the same type."""
    return leaf is reference or (isinstance(leaf, VALUE_TYPES) and type(leaf) is type(reference)
                                 and leaf == reference)


def program_of(layer: nn.Module, leaves: list, spec, lifted: LiftedNumbers | None = None
               ) -> tuple[tuple, tuple[Number, ...]]:
    """What `layer` computes when called with `leaves` (of `tree_flatten((args,
    kwargs))`, `spec`): the code and constants of its forward, and of its
    backward to its hidden state and weights where they require grad (the
    hidden state where the weights do), traced by `make_fx` on fakes; and
    the Python numbers of its arithmetic, in call order (`lifted_numbers`),
    of which the ordinals `lifted` holds are inputs of the trace. Layers
    of kinds whose programs are equal can share one scan's trace."""
    mode = fake_mode()
    weights = fake_weights(mode, layer)
    given = fake_leaves(mode, leaves)
    args, kwargs = tree_unflatten(given, spec)
    # The entries of a mapping every layer gets are inputs of their own, so
    # that layers reading different entries (by a setting) differ.
    mappings = [each for each in given if is_shared_mapping(each)]
    entries = [dict(each.items()) for each in mappings]
    # As a step of a scan: where the weights require grad, so does the hidden
    # state each layer but the first gets; the first's (an input, a frozen
    # embedding's output) must too, or its program would differ from theirs.
    if (args and isinstance(args[0], torch.Tensor) and args[0].dtype.is_floating_point
            and any(each.requires_grad for each in weights.values())):
        args[0].requires_grad_(True)
    differentiated = _Differentiated(layer)
    ordinals, dtypes = (lifted.ordinals, lifted.dtypes) if lifted is not None else ((), ())
    with faking(mode):
        numbers = [torch.empty((), dtype=dtype) for dtype in dtypes]
    seen = []

    def forward_and_backward(weights, args, kwargs, entries, numbers):
        for mapping, held in zip(mappings, entries):
            mapping.clear()
            mapping.update(held)
        # The backward too, where it recomputes the layer (gradient checkpointing).
        with Numbers(dict(zip(ordinals, numbers)), seen):
            return torch.func.functional_call(
                differentiated, {f"layer.{name}": each for name, each in weights.items()},
                (tuple(weights.values()), args, kwargs))

    # The layer's forward hooks would see the fakes (a stack replays them after its loop).
    with faking(mode), hooks_held(layer):
        graph = make_fx(forward_and_backward, tracing_mode="real")(weights, args, kwargs,
                                                                   entries, numbers)
    constants = [operator.attrgetter(node.target)(graph)
                 for node in graph.graph.nodes if node.op == "get_attr"]
    return (graph.code, tuple((tuple(each.shape), each.dtype, _value(each))
                              for each in constants if isinstance(each, torch.Tensor))), \
        tuple(seen)


def _value(constant: torch.Tensor) -> tuple | None:
    """A traced constant's values, where known (a fake made from a literal
    keeps them; one computed from fakes has none)."""
    if isinstance(constant, FakeTensor):
        constant = constant.constant
    return None if constant is None else tuple(constant.flatten().tolist())


class _Differentiated(nn.Module):
    """`layer`'s output and its gradients to its hidden state and `weights`
    (those that require grad), in one call: under `functional_call`, the
    backward too runs with the fakes as the layer's weights (a layer that
    recomputes itself in its backward, under transformers' gradient
    checkpointing, recomputes on them)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, weights: tuple, args: tuple, kwargs: dict):
        output = self.layer(*args, **kwargs)
        output = hidden_of(output)
        differentiable = [each for each in (*args[:1], *weights)  # (called by keywords only)
                          if isinstance(each, torch.Tensor) and each.requires_grad]
        if not output.requires_grad or not differentiable:
            return output
        return output, torch.autograd.grad(output, differentiable, torch.ones_like(output),
                                           allow_unused=True)
