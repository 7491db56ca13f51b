"""Layers of several kinds as one scan: a model whose layers differ only in
settings that pick what the model's loop hands each kind (Gemma's sliding
and full attention get their kind's mask and rotary table) runs one layer's
code for every layer, each given its kind's arguments.

Three pieces, used by a stack of such layers:

* `compare_kinds`: whether the kinds differ only in settings, and which
  (`kind_attributes`: equal within a kind, different between kinds, kept
  per layer by the stack), or in structure (other submodules or tensors),
  which needs a scan per kind (`groups`): the one place that decides;
* `KindCalls`: the model's loop calls each layer with its kind's arguments;
  the calls are recorded until every kind has been called once, and become
  one call whose differing arguments are `PerLayerChoice`s: the scan takes
  each variant once and each layer picks its kind's inside the loop;
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
from typing import Hashable, Iterable, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import (
    keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten)

from torch_xla_ext.layer_stack.alike import names_its_module, layout_of, structure_difference
from torch_xla_ext.layer_stack.forms import differences
from torch_xla_ext.layer_stack.hooks import hooks_held
from torch_xla_ext.object_graph import VALUE_TYPES

__all__ = ["PerLayerChoice", "KindCalls", "KindsCompared", "call_for_layer", "compare_kinds",
           "kind_attributes", "program_difference"]


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


@dataclasses.dataclass(frozen=True)
class KindsCompared:
    """What comparing the first layer of each kind with layer 0 found. Either
    the kinds differ in structure (`structure` says how: other submodules,
    parameters, buffers or setting names), so one layer's code cannot run
    them all and each needs scans of its own (`groups.GroupedLayers`); or
    they differ only in the values of the attributes `settings` (their names:
    `sliding_window`, `layer_type`, ...), so one scan can stand for every kind
    (`structure` is None)."""
    settings: frozenset[str]
    structure: str | None = None


def compare_kinds(layers: Sequence[nn.Module], kinds: Sequence[Hashable]) -> KindsCompared:
    """Compares the first layer of each of `kinds` (one per layer) with layer 0
    (see `KindsCompared`); strings that name their module (see `alike`) are
    no difference."""
    first_of_kind = {kind: kinds.index(kind) for kind in dict.fromkeys(kinds)}
    reference = layout_of(layers[0], 0)
    names = set()
    for index in first_of_kind.values():
        layout = layout_of(layers[index], index)
        difference = structure_difference(index, reference, layout)
        if difference is not None:
            return KindsCompared(frozenset(), difference[1])
        for name, form in reference.settings.items():
            owner_path, _, attribute = name.rpartition(".")
            if any(not names_its_module(index, owner_path, *difference[1:])
                   for difference in differences(form, layout.settings[name])):
                names.add(attribute)
    return KindsCompared(frozenset(names))


def kind_attributes(layers: Sequence[nn.Module], kinds: Sequence[Hashable],
                    per_layer_attributes: Iterable[str]) -> frozenset[str]:
    """The names of the attributes (`sliding_window`, `layer_type`, ...) whose
    values differ between the first layers of different kinds (other than
    `per_layer_attributes`, which differ anyway; see `compare_kinds`). Raises
    ValueError when the kinds differ in structure, or naming an attribute
    that differs between two layers of the same kind."""
    compared = compare_kinds(layers, kinds)
    if compared.structure is not None:
        raise ValueError(
            f"the layers' kinds {list(dict.fromkeys(kinds))} differ in more than their "
            f"settings ({compared.structure}), so one layer's code cannot run them all in "
            f"one scan; stack them as a GroupedLayers (a scan per segment of their pattern).")
    names = compared.settings - frozenset(per_layer_attributes)
    layouts = [layout_of(layer, index) for index, layer in enumerate(layers)]
    first_of_kind = {kind: kinds.index(kind) for kind in dict.fromkeys(kinds)}
    for index, (kind, layout) in enumerate(zip(kinds, layouts)):
        first = first_of_kind[kind]
        for name, form in layout.settings.items():
            if (name.rpartition(".")[2] in names and name in layouts[first].settings
                    and any(differences(layouts[first].settings[name], form))):
                raise ValueError(
                    f"Layer {index} setting '{name}' differs from layer {first}'s, the first "
                    f"layer of the same kind {kind!r}; layers of one kind must be built alike.")
    return names


class KindCalls:
    """The calls of the model's loop over layers of `kinds`, one per layer, in
    order: the first call of each kind is recorded (the layers before the
    last of them hand the hidden state on unchanged), later calls must pass
    their kind's very arguments, and every call after the first must get
    what the previous one returned (the stack's output, once it ran). The
    layers are numbered from `first` in messages (a segment of a model's
    layers)."""

    def __init__(self, kinds: Sequence[Hashable], first: int = 0):
        self.kinds = tuple(kinds)
        self.first = first
        self.order = list(dict.fromkeys(self.kinds))  # the kinds by first layer
        self.kind_index = tuple(self.order.index(kind) for kind in self.kinds)
        # The layer whose call completes the recording and runs the stack.
        self.last_first = max(self.kinds.index(kind) for kind in self.order)
        self._hidden = None  # what each call must get: layer 0's input, then the stack's output
        self._calls: dict[int, tuple] = {}

    def record(self, index: int, hidden, args: tuple, kwargs: dict) -> bool:
        """Records or checks layer `index`'s call; True when the stack is to run now."""
        kind, layer = self.kind_index[index], self.first + index
        if index == 0:
            self._hidden, self._calls = hidden, {}
        elif hidden is not self._hidden:
            raise RuntimeError(
                f"layer {layer} got another hidden state than layer {layer - 1} returned: the "
                f"layers run as one scan when layer {self.first + self.last_first}, the first "
                f"of the last kind, is called, and the other calls hand the hidden state on; "
                f"call them in order, each on what the previous one returned, with nothing "
                f"between them.")
        if kind not in self._calls:
            self._calls[kind] = (args, kwargs)
        else:
            reference = self.first + self.kind_index.index(kind)
            _check_same_call(layer, reference, self._calls[kind], (args, kwargs))
        return index == self.last_first

    def ran(self, output):
        """Notes the stack's output, which the later layers' calls must get; returns it."""
        self._hidden = output
        return output

    def calls(self) -> list[tuple]:
        """Each kind's (args, kwargs), in `order`."""
        return [self._calls[kind] for kind in range(len(self.order))]

    def clear(self) -> None:
        """Forgets the recorded calls, whose tensors would otherwise stay alive
        (and be materialized at the next sync)."""
        self._hidden, self._calls = None, {}

    def merged(self, calls: list[tuple]) -> tuple[tuple, dict]:
        """One call for every layer: where the kinds' calls differ, a PerLayerChoice."""
        flat = [tree_flatten(call) for call in calls]
        spec = flat[0][1]
        if any(other_spec != spec for _, other_spec in flat[1:]):
            # Differently shaped calls: each layer gets its kind's whole call.
            return (PerLayerChoice(tuple(calls), self.kind_index, whole_call=True),), {}
        leaves = []
        for variants in zip(*(leaves for leaves, _ in flat)):
            if all(same_leaf(variant, variants[0]) for variant in variants[1:]):
                leaves.append(variants[0])
            else:
                leaves.append(PerLayerChoice(tuple(variants), self.kind_index))
        return tree_unflatten(leaves, spec)


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


def differing_argument(first: tuple, other: tuple) -> str | None:
    """The first argument of `other` ('kwargs['attention_mask']') that is not
    `first`'s (`same_leaf`)."""
    # Every layer after the first of its kind or group is checked, each step: the common
    # case, the very same objects, without flattening them; then all the same
    # leaves, without building the arguments' paths.
    if _same_objects(first, other):
        return None
    (first_leaves, first_spec), (other_leaves, other_spec) = map(tree_flatten, (first, other))
    if first_spec == other_spec and all(map(same_leaf, other_leaves, first_leaves)):
        return None
    first_leaves, other_leaves = (tree_flatten_with_path(each)[0] for each in (first, other))
    first_paths = [path for path, _ in first_leaves]
    for path, leaf in other_leaves:
        if path not in first_paths:
            return argument_path(path)
        if not same_leaf(leaf, first_leaves[first_paths.index(path)][1]):
            return argument_path(path)
    missing = [path for path in first_paths if path not in {path for path, _ in other_leaves}]
    return argument_path(missing[0]) if missing else None


def _same_objects(first: tuple, other: tuple) -> bool:
    """Whether two (args, kwargs) hold the very same objects, position by position."""
    (first_args, first_kwargs), (other_args, other_kwargs) = first, other
    return (len(first_args) == len(other_args) and first_kwargs.keys() == other_kwargs.keys()
            and all(map(operator.is_, first_args, other_args))
            and all(other_kwargs[name] is value for name, value in first_kwargs.items()))


def _check_same_call(layer: int, reference: int, recorded: tuple, call: tuple) -> None:
    """Raises unless layer `layer` got the arguments of layer `reference`, the
    first of its kind, which the scan gives it."""
    differing = differing_argument(recorded, call)
    if differing is None:
        return
    raise ValueError(
        f"layer {layer} is called with other arguments than layer {reference}, the first "
        f"layer of its kind: its argument {differing} is not the one layer {reference} got. "
        f"The layers run as one scan, each with the arguments of the first layer of its "
        f"kind, so layer {layer} would silently get those. Pass every layer of a kind the "
        f"same argument objects, or run this model unconverted.")


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
