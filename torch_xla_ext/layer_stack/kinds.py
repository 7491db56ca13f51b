"""Layers of several kinds as one scan: layers that differ only in settings
that pick what the model's loop hands each kind (Gemma's sliding and full
attention get their kind's mask and rotary table) run one layer's code for
every layer, each given its kind's arguments.

* `PerLayerChoice`: an argument that differs between the layers' calls;
  the scan takes each variant once (stacked) and each layer picks its own
  inside the loop (`call_for_layer` gives a layer its call, outside it);
* `program_difference`: one trace stands for every kind only if the layer
  computes the same with each kind's settings. Each kind's layer is traced
  by `make_fx` on fake CPU tensors (no data) and the graphs and their
  constants compared: a setting that only reaches code that ignores it
  (transformers' eager and SDPA attention take `sliding_window` and drop it)
  changes nothing.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import keystr, tree_map

from torch_xla_ext.layer_stack.hooks import hooks_held
from torch_xla_ext.object_graph import VALUE_TYPES

__all__ = ["PerLayerChoice", "call_for_layer", "is_choice", "program_difference", "same_leaf"]


@dataclasses.dataclass(frozen=True)
class PerLayerChoice:
    """An argument that differs between the layers of a stack: layer i gets
    `variants[choice[i]]`. As a leaf of a stack's call arguments, its
    variants enter the scan once (stacked, when they are tensors of one
    shape and dtype) and each step picks its layer's."""
    variants: tuple
    choice: tuple[int, ...]
    whole_call: bool = False  # each variant is a layer's whole (args, kwargs)

    def for_layer(self, index: int):
        return self.variants[self.choice[index]]


def is_choice(leaf) -> bool:
    return isinstance(leaf, PerLayerChoice)


def for_layer(tree, index: int):
    """`tree` with each PerLayerChoice replaced by layer `index`'s variant."""
    return tree_map(lambda leaf: leaf.for_layer(index) if is_choice(leaf) else leaf, tree)


def call_for_layer(args: tuple, kwargs: dict, index: int) -> tuple[tuple, dict]:
    """Layer `index`'s call: its variant of each PerLayerChoice (of the whole
    call, when `KindCalls.merged` made one of calls that differ in form)."""
    if not kwargs and len(args) == 1 and is_choice(args[0]) and args[0].whole_call:
        return args[0].for_layer(index)
    return for_layer((args, kwargs), index)


def argument_path(path) -> str:
    """'args[1]' or "kwargs['mask']" for a leaf path of the pytree `(args, kwargs)`."""
    return ("args" if path[0].idx == 0 else "kwargs") + keystr(path[1:])


def same_leaf(leaf, reference) -> bool:
    """The same object, or an equal plain constant of the same type."""
    return leaf is reference or (isinstance(leaf, VALUE_TYPES) and type(leaf) is type(reference)
                                 and leaf == reference)


def program_difference(kind_layers: Sequence[nn.Module], stacked_tensors: dict, hidden,
                       args: tuple, kwargs: dict, recording=None, state: tuple = ()
                       ) -> str | None:
    """Why one trace cannot stand for every kind: None when each kind's layer
    in `kind_layers`, called as a stack's step calls it (on one slice of
    `stacked_tensors`, with layer 0's variant of each PerLayerChoice and what
    `recording` gives a layer), computes the same forward and backward graph
    with the same constants; else which kind's differs."""
    args, kwargs = call_for_layer(args, kwargs, 0)
    graphs = [_graph(layer, stacked_tensors, hidden, args, kwargs, recording, state)
              for layer in kind_layers]
    for number, graph in enumerate(graphs[1:], start=1):
        if graph != graphs[0]:
            return (f"the layer computes another graph with the settings of its kind "
                    f"{number} than with those of its kind 0")
    return None


def _graph(layer: nn.Module, stacked_tensors: dict, hidden, args: tuple, kwargs: dict,
           recording, state: tuple) -> tuple:
    """The code and constants of `layer`'s forward and backward, traced on fakes."""
    mode = FakeTensorMode()

    def fake(tensor, shape=None):
        if not isinstance(tensor, torch.Tensor):
            return tensor
        with mode:
            # On the CPU: constants the layer makes then hold their values.
            made = torch.empty(tensor.shape if shape is None else shape, dtype=tensor.dtype)
        return made.requires_grad_(tensor.requires_grad and tensor.dtype.is_floating_point)

    weights = {name: fake(tensor, tensor.shape[1:]) for name, tensor in stacked_tensors.items()}
    inputs = tree_map(fake, (hidden, args, kwargs, state))
    with mode:
        # An input, as in the loop's step (a constant made here would be a fake).
        index = torch.zeros((), dtype=torch.long)

    def forward_and_backward(weights, index, hidden, args, kwargs, state):
        given = recording.make(index, state) if recording is not None else {}
        output = torch.func.functional_call(layer, weights, (hidden, *args),
                                            {**kwargs, **given})
        output = output[0] if isinstance(output, tuple) else output
        differentiable = [each for each in (hidden, *weights.values()) if each.requires_grad]
        if not output.requires_grad or not differentiable:
            return output
        return output, torch.autograd.grad(output, differentiable, torch.ones_like(output),
                                           allow_unused=True)

    # The layer's forward hooks would see the fakes (a stack replays them after its loop).
    with mode, hooks_held(layer):
        graph = make_fx(forward_and_backward, tracing_mode="real")(weights, index, *inputs)
    constants = [operator.attrgetter(node.target)(graph)
                 for node in graph.graph.nodes if node.op == "get_attr"]
    return graph.code, tuple((tuple(each.shape), each.dtype, each.tolist())
                             for each in constants if isinstance(each, torch.Tensor))
