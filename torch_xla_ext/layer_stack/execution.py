"""Running a forward's layer calls as its call plan says.

An `Execution` is the driver of one forward's loop over one stacked list
(`owner_loops`). Each `LayerCall` comes to it in order. A layer that runs as
itself, or one by one, runs at its call. The calls of a scan are checked
against the plan (each gets what the call before returned, the same
objects as the first call where the plan shares them, a tensor per layer
where it chooses them) and recorded; at the call of the run's trigger the
scan runs (`StackedList.scan_run`), and each call returns what its layer
would: its hidden state and the values the next layer gets from it (the
scan's results at the last layer, or placeholders that the next call hands
on), the arguments it hands back, its constants, and the per-layer values
the forward keeps, from what the scan stacked.

If the scan cannot run (the run's reason, a `LayerByLayerWarning`), the
layers recorded so far run one by one at the trigger, and the later ones
at their calls: the results are the loop's either way.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from torch.utils._pytree import tree_flatten, tree_unflatten

from torch_xla_ext.diagnostics import Refusal
from torch_xla_ext.layer_stack.executors import executor_of_call
from torch_xla_ext.layer_stack.planner import SCAN, CallPlan, Run
from torch_xla_ext.layer_stack.kinds import PerLayerChoice, same_leaf
from torch_xla_ext.layer_stack.operands import LAYER_INDEX, HandedOn
from torch_xla_ext.layer_stack.scan_runner import warn_layer_by_layer

__all__ = ["Execution", "ScanResult", "scan_result"]


@dataclasses.dataclass(frozen=True)
class ScanResult:
    """What a run's scan gives: the last layer's hidden state, the
    per-layer values the forward keeps, `(position, output leaf) -> [groups, ...]`,
    and the last layer's output leaves that each layer hands the next
    (`Run.handed_outputs`), by number."""
    hidden: Any
    kept: dict
    handed: dict = dataclasses.field(default_factory=dict)


def scan_result(run, outcome) -> ScanResult | Refusal:
    """`scan_runner.attempt`'s outcome for `run` as its execution takes it."""
    if isinstance(outcome, Refusal):
        return outcome
    hidden, kept, handed = outcome
    return ScanResult(hidden, {(0, leaf): stacked for leaf, stacked in zip(run.kept[0], kept)}
                      if run.kept else {}, handed)


@dataclasses.dataclass
class _RunState:
    calls: list = dataclasses.field(default_factory=list)  # (leaves, spec) of each call so far
    returned: list = dataclasses.field(default_factory=list)  # the last call's output leaves
    result: ScanResult | None = None
    one_by_one: bool = False  # the scan could not run: each layer runs at its call


class Execution:
    """The driver of one forward's loop over `stack` (a `StackedList`), as `plan` says."""

    def __init__(self, stack, plan: CallPlan, stand_ins: dict | None = None):
        self.stack = stack
        self.plan = plan
        # The placeholders that stand for the layers' outputs between them, by
        # (layer, output leaf): kept with the plan, so that each call of its
        # kind hands the owner the same ones rather than make them again.
        self.stand_ins = {} if stand_ins is None else stand_ins
        self.states: dict[int, _RunState] = {}  # by run start
        self.warned: set = set()  # the runs (None: the whole call) warned of

    def call(self, index: int, args: tuple, kwargs: dict):
        run = self.plan.run_at.get(index)
        if run is None or run.how != SCAN:
            reason = self.plan.reason if run is None else run.reason
            if reason is not None and run not in self.warned:
                self.warned.add(run)
                count = run.stop - run.start if run else len(self.stack)
                warn_layer_by_layer(count, reason, stacklevel=6)
            return self.stack.call_layer(index, args, kwargs)
        state = self.states.setdefault(run.start, _RunState())
        if state.one_by_one:
            return self._finish(run, index, self.stack.call_layer(index, args, kwargs))
        leaves, spec = tree_flatten((args, kwargs))
        self._check(run, state, index, leaves, spec)
        state.calls.append((leaves, spec))
        if index == run.trigger:
            outcome = self.stack.scan_run(run, *self._scan_call(run, state))
            if isinstance(outcome, Refusal):
                warn_layer_by_layer(run.stop - run.start, outcome.reason, stacklevel=6)
                state.one_by_one = True
                return self._finish(run, index, self._recorded_one_by_one(run, state))
            state.result = outcome
        return self._finish(run, index, self._output(run, state, index, leaves))

    def _finish(self, run: Run, index: int, output):
        state = self.states[run.start]
        state.returned = tree_flatten(output)[0]
        if index == run.stop - 1:
            del self.states[run.start]  # its tensors are not kept past the loop
        return output

    def _check(self, run: Run, state: _RunState, index: int, leaves: list, spec) -> None:
        """Raises unless call `index` is what the plan says it is."""
        offset = index - run.start
        if offset != len(state.calls):
            raise RuntimeError(
                f"layer {index} is called out of order: {run} run as one scan, and the calls "
                f"so far were of layers {run.start}-{run.start + len(state.calls) - 1}; call "
                f"the layers in order.")
        if offset and leaves[0] is not state.returned[0]:
            raise RuntimeError(
                f"layer {index} got another hidden state than layer {index - 1} returned: "
                f"{run} run as one scan, each layer on what the one before returned; call "
                f"them in order, each on what the previous one returned, with nothing "
                f"between them.")
        position, group = offset % run.period, offset // run.period
        for number, plan in enumerate(run.leaves[position][1:], start=1):
            if plan.kind == "index" and not (type(leaves[number]) is int
                                             and leaves[number] == index):
                raise ValueError(
                    f"layer {index} is given {leaves[number]!r} as leaf {number} of its "
                    f"arguments, where the loop gave each layer its own index when this kind "
                    f"of call was planned: {run} run as one scan, which gives each layer its "
                    f"index there. Pass the layers their indices as before, or run this model "
                    f"unconverted.")
            if offset and plan.kind == "handed" and leaves[number] is not state.returned[
                    plan.output]:
                raise RuntimeError(
                    f"layer {index} got another value (leaf {number} of its arguments) than "
                    f"layer {index - 1} returned as its output leaf {plan.output}: {run} run as "
                    f"one scan, which hands each layer that value of the one before; call the "
                    f"layers as when this kind of call was planned.")
        if offset < run.period:
            return
        reference_leaves, reference_spec = state.calls[position]
        if spec != reference_spec:
            raise ValueError(f"layer {index} is called with arguments of another form than "
                             f"layer {run.start + position}: {run} run as one scan.")
        for number, plan in enumerate(run.leaves[position][1:], start=1):
            first = (0 if plan.kind == "shared"
                     else plan.choice.index(plan.choice[group]) if plan.kind == "chosen"
                     else None)
            if first is None or first == group:
                continue
            expected = state.calls[first * run.period + position][0][number]
            if leaves[number] is not expected and not same_leaf(leaves[number], expected):
                raise ValueError(
                    f"layer {index} is called with another argument (leaf {number} of its "
                    f"arguments) than layer {run.start + first * run.period + position}, which "
                    f"the loop gave the same one when this kind of call was planned: {run} run "
                    f"as one scan, each layer given what the plan says. Pass the layers the "
                    f"same argument objects as before, or run this model unconverted.")

    def _scan_call(self, run: Run, state: _RunState) -> tuple:
        """(hidden, args, kwargs) of the scan: the first call's, with a
        PerLayerChoice where the plan chooses an argument per layer; for a
        run of groups, the first group's calls by position."""
        calls = []
        for position in range(run.period):
            leaves, spec = state.calls[position]
            merged = list(leaves)
            for number, plan in enumerate(run.leaves[position][1:], start=1):
                if plan.kind == "handed":
                    merged[number] = HandedOn(leaves[number], plan.output)
                elif plan.kind == "chosen":
                    variants = tuple(state.calls[plan.choice.index(variant) * run.period
                                                 + position][0][number]
                                     for variant in range(max(plan.choice) + 1))
                    merged[number] = PerLayerChoice(variants, plan.choice)
                elif plan.kind == "index":
                    merged[number] = LAYER_INDEX
            args, kwargs = tree_unflatten(merged, spec)
            calls.append((args[1:], kwargs))
        hidden = state.calls[0][0][0]
        if run.period == 1:
            return hidden, calls[0][0], calls[0][1]
        return hidden, (), {"calls": tuple(calls)}

    def _recorded_one_by_one(self, run: Run, state: _RunState):
        """Runs the layers whose calls were recorded, one by one, each on what
        the one before returned (its hidden state and the values it hands
        on); the output of the last."""
        handed = [(number, plan.output) for number, plan in enumerate(run.leaves[0])
                  if plan.kind == "handed"]
        returned = None
        for offset, (leaves, spec) in enumerate(state.calls):
            if offset:
                leaves = [returned[0], *leaves[1:]]
                for number, output in handed:
                    leaves[number] = returned[output]
            args, kwargs = tree_unflatten(leaves, spec)
            output = self.stack.call_layer(run.start + offset, args, kwargs)
            returned = tree_flatten(output)[0]
        return output

    def _output(self, run: Run, state: _RunState, index: int, leaves: list):
        """What layer `index`'s call returns (see the module docstring)."""
        offset = index - run.start
        position, group = offset % run.period, offset // run.period
        spec, sources = run.outputs[position]
        result, values = state.result, []
        for number, source in enumerate(sources):
            if source.kind == "argument":
                values.append(leaves[source.value])
            elif source.kind == "constant":
                values.append(source.value)
            elif number == 0 and index == run.stop - 1:
                values.append(result.hidden)
            elif index == run.stop - 1 and number in result.handed:
                values.append(result.handed[number])
            elif result is not None and number in run.kept[position]:
                values.append(result.kept[position, number][group])
            else:
                values.append(self._stand_in(index, number, source.value, leaves[0]))
        return tree_unflatten(values, spec)

    def _stand_in(self, index: int, number: int, aval: tuple, hidden):
        """The stand-in for output leaf `number` of layer `index`, on the
        device of its `hidden` state (`Executor.stand_in`)."""
        if (index, number) in self.stand_ins:
            # Read no metadata of `hidden`: a placeholder's goes through
            # its __torch_function__, at each layer's call.
            return self.stand_ins[index, number]
        made, kept = executor_of_call().stand_in(*aval, hidden.device)
        if kept:
            self.stand_ins[index, number] = made
        return made
