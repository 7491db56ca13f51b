"""The loop over a forward's stacked layers as Dynamo traces it: each run of
layers one call of torch's scan operator in Dynamo's graph.

`torch.compile(fullgraph=True)` cannot break its graph at the loop
(`owner_loops.at_graph_break`), and Dynamo can trace neither the call plan's
making (the dry run's fakes, the comparison of programs) nor the layer's
forward inside the operator's body (`functional_call`'s reparametrizing
context manager). So what Dynamo sees is decided before it traces, as data:
when an eager call plans a kind of call (`plan_store.OwnerPlans`), `traced_runs`
also makes, for each run of the plan, a `TracedRun`: the layer traced once
by `make_fx` on fakes into a graph `(weights, hidden, *tensor arguments) ->
hidden`, which Dynamo inlines into the operator's body, and where each
layer's output comes from. Under Dynamo, the owner's hooks look the kind of
call up; with `TracedRun`s for it, a `TracedExecution` drives the loop: the
run's first call is the scan over the stacked tensors, and each call gives
what the plan says.

A plan that this cannot follow gets the reason instead, and under Dynamo its
loop runs at a graph break, as without `fullgraph` (`owner_loops`): arguments that
are not tensors or constants (a key/value cache, written in place), layers
that differ in settings or numbers, a policy or `unroll` (the operator has no
place for them), per-layer values the forward keeps, runs of groups, tensor
arguments that require grad (torch 2.9's operator differentiates the tensors
its body captures wrongly), a layer that reads a per-layer attribute, and a
forward that reads an attribute of a loop item (`decoder_layer.attention_type`)
that is not a plain constant. The plain ones the dry run saw are kept with the
runs (`TracedLoop`), and Dynamo's loop items give them as constants. With the
switch on, an eager call whose loop Dynamo will not trace says why, once per
kind of call (`GraphBreakWarning`).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from torch._higher_order_ops.scan import scan as torch_scan
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from torch_xla_ext.layer_stack.planner import SCAN, CallPlan, Run
from torch_xla_ext.layer_stack.fakes import apart_from_trace
from torch_xla_ext.layer_stack.kinds import hidden_of
from torch_xla_ext.layer_stack.per_layer import read_refusal, reads_recorded_in, reads_watched
from torch_xla_ext.object_graph import VALUE_TYPES
from torch_xla_ext.policies import save_everything
from torch_xla_ext.diagnostics import Refusal, TorchXlaExtWarning

__all__ = ["GraphBreakWarning", "TracedExecution", "TracedLoop", "TracedRun",
           "trace_loops_in_dynamo", "traced_loops", "traced_runs", "warn_graph_break"]

# Whether the loops are traced by Dynamo: off by default, since torch_xla's own
# `openxla` backend cannot take the operator's node (its dynamo bridge refuses
# the body as an argument); `openxla_scan` can.
_SWITCH = {"on": False}


def trace_loops_in_dynamo(enabled: bool = True) -> None:
    """From now on (in this process), calls planned while `enabled` have
    their loops traced by Dynamo as torch's scan operator, with a backend
    that runs the operator (`openxla_scan`, TorchTPU's); otherwise, Dynamo
    breaks its graph at the loop. Set before the first (eager) call of a kind."""
    _SWITCH["on"] = bool(enabled)


def traced_loops() -> bool:
    """Whether `trace_loops_in_dynamo` is on."""
    return _SWITCH["on"]


class GraphBreakWarning(TorchXlaExtWarning):
    """With `trace_loops_in_dynamo` on, a kind of call whose loop Dynamo will
    not trace: under torch.compile, it runs at a graph break (which
    `fullgraph=True` refuses)."""


def warn_graph_break(owner, name: str, reason: str) -> None:
    """Says, at the eager call that planned a kind of call, why Dynamo will
    not trace `owner`'s loop over its list `name`."""
    warnings.warn(f"trace_loops_in_dynamo: under torch.compile, {type(owner).__qualname__}'s "
                  f"loop over {name!r} will run at a graph break for this kind of call "
                  f"(fullgraph=True refuses it), since {reason}", GraphBreakWarning, stacklevel=2)


@dataclasses.dataclass  # not frozen: Dynamo reconstructs no frozen dataclass of a source
class TracedRun:
    """A run of layers as Dynamo traces it: layers `start`, ..., `stop - 1`
    of the list, the slices `first`, ..., `first + stop - start - 1` of
    stored segment `segment`'s stacked tensors, each layer `body(weights,
    hidden, *the call's tensor argument leaves at tensor_leaves)`; a layer's
    output is of form `output_spec`, its leaves the body's hidden state
    (`None`) or argument leaf `("argument", n)` or constant `("constant", v)`."""
    start: int
    stop: int
    segment: int
    first: int
    body: torch.fx.GraphModule
    tensor_leaves: tuple[int, ...]
    output_spec: TreeSpec
    output_sources: tuple[Any, ...]


@dataclasses.dataclass
class TracedLoop:
    """A forward's loop over a stacked list as Dynamo traces it: its `runs`,
    and what the forward reads of its items (by layer index and attribute
    name, the plain value the dry run read)."""
    runs: tuple[TracedRun, ...]
    attributes: dict[int, dict[str, Any]]


def traced_runs(stack, plan: CallPlan, calls: list, attributes_read: dict
                ) -> TracedLoop | Refusal:
    """The `TracedLoop` of `plan`, a plan of `stack`'s (a `StackedList`) from
    the dry run's `calls` (`dry_run.RecordedCall`s) and the attributes it
    read of the loop's items (`CallRecord.attributes_read`), or why Dynamo
    cannot trace the loop as scans; runs on the CPU's fakes, apart
    from any trace."""
    if plan.reason is not None:
        return Refusal(plan.reason)
    for index, attributes in sorted(attributes_read.items()):
        for name, value in attributes.items():
            if not isinstance(value, VALUE_TYPES):
                return Refusal(f"the forward reads layer {index}'s attribute {name!r}, a "
                               f"{type(value).__name__}, which Dynamo's graph cannot hold as a "
                               f"constant (plain values can be)")
    by_index = {call.index: call for call in calls}
    made = []
    for run in plan.runs:
        traced = _traced_run(stack, run, by_index.get(run.start))
        if isinstance(traced, Refusal):
            return Refusal(f"layers {run.start}-{run.stop - 1}: {traced.reason}")
        made.append(traced)
    return TracedLoop(tuple(made), {index: dict(attributes)
                                    for index, attributes in attributes_read.items()})


def _traced_run(stack, run: Run, call) -> TracedRun | Refusal:
    if run.how != SCAN:
        return Refusal(run.reason or f"the plan runs them {run.how}")
    if run.period != 1:
        return Refusal("they run as groups of layers of several kinds")
    settings = stack.differing_settings(run.start, run.stop)
    if settings:
        return Refusal(f"the layers differ in settings {settings}; one traced layer stands "
                       f"for all")
    if run.numbers is not None:
        return Refusal("the layers differ in numbers of their arithmetic; one traced layer "
                       "stands for all")
    if any(run.kept):
        return Refusal("the forward keeps each layer's output, which the scan's one result "
                       "cannot give")
    if call is None or any(leaf.kind != "shared" for leaf in run.leaves[0][1:]):
        return Refusal("the layers are given arguments that differ between them")
    layers = stack.runner(run)
    if layers.shared_tensors:
        return Refusal("the layers share parameters, which the traced layer would capture")
    if layers.partition_fn is not save_everything or layers.unroll != 1 or (
            layers.unit_output is not None or layers.hooks_replayed):
        return Refusal(f"torch's scan operator has no place for the stack's partition_fn="
                       f"{layers.partition_fn!r}, unroll={layers.unroll!r}, FSDPv2 output "
                       f"sharding or replayed hooks")
    leaves = call.leaves
    if not isinstance(leaves[0], torch.Tensor):
        return Refusal("the hidden state is not one tensor")
    tensor_leaves = []
    for number, leaf in enumerate(leaves[1:], start=1):
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                return Refusal(f"argument leaf {number} requires grad, and torch 2.9's scan "
                               f"operator differentiates the tensors its body captures wrongly")
            tensor_leaves.append(number)
        elif not isinstance(leaf, VALUE_TYPES):
            return Refusal(f"argument leaf {number} is a {type(leaf).__name__}, and the "
                           f"operator's body takes tensors and constants")
    output_spec, sources = run.outputs[0]
    output_sources = []
    for number, source in enumerate(sources):
        if number == 0 and source.kind == "computed":
            output_sources.append(None)
        elif source.kind in ("argument", "constant"):
            output_sources.append((source.kind, source.value))
        else:
            return Refusal(f"the layer's output leaf {number} is {source.kind}, not the hidden "
                           f"state")
    body = _layer_graph(layers, leaves, call.spec, tuple(tensor_leaves))
    if isinstance(body, Refusal):
        return body
    segment_start = stack.plan[run.segment].start
    return TracedRun(run.start, run.stop, run.segment, run.start - segment_start, body,
                     tuple(tensor_leaves), output_spec, tuple(output_sources))


def _layer_graph(layers, leaves: list, spec: TreeSpec, tensor_leaves: tuple[int, ...]):
    """The template's call on one layer's weights as a graph of aten ops,
    traced by make_fx on fakes, or why it cannot stand for every layer."""
    template = layers.template

    def one_layer(weights, hidden, *tensors):
        given = list(leaves)
        given[0] = hidden
        for number, tensor in zip(tensor_leaves, tensors):
            given[number] = tensor
        args, kwargs = tree_unflatten(given, spec)
        return hidden_of(torch.func.functional_call(template, weights, args, kwargs,
                                                    strict=True))

    weights = {name: tensor[0].detach() for name, tensor in layers.stacked_tensors.items()}
    examples = [leaves[0].detach(), *(leaves[number].detach() for number in tensor_leaves)]
    reads = set()
    try:
        with apart_from_trace(), torch.no_grad(), reads_watched(
                template, layers.per_layer_paths), reads_recorded_in(reads):
            graph = make_fx(one_layer, tracing_mode="fake")(weights, *examples)
    except Exception:
        # After a per-layer read the trace went on with layer 0's value (as
        # in scan_runner's step): the read is the reason.
        if read_refusal(reads, layers.per_layer_paths) is None:
            raise
    refusal = read_refusal(reads, layers.per_layer_paths)
    return graph if refusal is None else Refusal(refusal)


class TracedExecution:
    """The driver of one forward's loop over `stack` under Dynamo, as its
    `TracedRun`s say: the calls of a run are checked to be the planned ones,
    its first call runs the scan, and each call returns its layer's output
    (the last hidden state; earlier layers', which the forward only hands on,
    are the same tensor)."""

    def __init__(self, stack, loop: TracedLoop):
        self.stack = stack
        self.runs = loop.runs
        self.attributes = loop.attributes
        self.results: dict[int, torch.Tensor] = {}  # by run start
        self.given: dict[int, list] = {}  # the run's first call's leaves

    def call(self, index: int, args: tuple, kwargs: dict):
        run = next((run for run in self.runs if run.start <= index < run.stop), None)
        if run is None:
            raise RuntimeError(f"layer {index} is called outside the runs planned for this kind "
                               f"of call; call the layers as when this kind of call was planned.")
        leaves, _ = tree_flatten((args, kwargs))
        if index == run.start:
            self.given[run.start] = leaves
            self.results[run.start] = self._scan(run, leaves)
        elif run.start not in self.results or leaves[0] is not self.results[run.start] or any(
                leaves[number] is not self.given[run.start][number]
                for number in run.tensor_leaves):
            raise RuntimeError(
                f"layer {index} is not called on what layer {index - 1} returned with the "
                f"arguments layer {run.start} got: layers {run.start}-{run.stop - 1} run as one "
                f"scan; call them in order, as when this kind of call was planned.")
        hidden = self.results[run.start]
        return tree_unflatten([hidden if source is None else
                               leaves[source[1]] if source[0] == "argument" else source[1]
                               for source in run.output_sources], run.output_spec)

    def attribute(self, index: int, name: str):
        """Layer `index`'s attribute `name` as the forward read it when an
        eager call planned this kind of call."""
        read = self.attributes.get(index, {})
        if name not in read:
            raise AttributeError(
                f"layer {index} of the stacked list is a stand-in in Dynamo's trace "
                f"(trace_loops_in_dynamo), which knows the attributes the forward read of it "
                f"when an eager call planned this kind of call, and {name!r} is not one of "
                f"them ({sorted(read)}); call the model eagerly first with the same kind of "
                f"call as under torch.compile, or call trace_loops_in_dynamo(False)")
        return read[name]

    def _scan(self, run: TracedRun, leaves: list) -> torch.Tensor:
        segment = self.stack.segments[run.segment]
        stop = run.first + run.stop - run.start
        # The stacked tensors as the eager call that planned the kind of call
        # left them (`storage.LayerStorage.operands`).
        weights = {name: tensor[run.first:stop]
                   for name, tensor in segment.storage.stacked.items()}
        tensors = [leaves[number] for number in run.tensor_leaves]
        body = run.body

        def step(hidden, layer_weights):
            return body(layer_weights, hidden, *tensors), ()

        last, _ = torch_scan(step, leaves[0], weights)
        return last
