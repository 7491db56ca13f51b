"""How a forward's calls of its stacked layers run: the call plan.

`plan_calls` reads what the dry run recorded (`dry_run.CallRecord`) and
decides, once per kind of call, how each layer's call runs, as data
(`CallPlan`): the called layers split into `Run`s, each

* a scan (`how == "scan"`): consecutive layers of one segment (or whole
  groups of a repeating pattern), each called on what the one before
  returned, with arguments that are the same objects in every call
  (`shared`), that differ between layers (`chosen`: tensors, each layer
  given its own, which the scan takes stacked), or that each layer gets
  from the one before besides its hidden state (`handed`: a value it
  computed, which the scan carries with the hidden state; the run's first
  layer gets it from the forward, and the forward gets the last layer's);
  it runs when the call of its `trigger` layer comes, the one by which
  every argument has been seen;
* a layer that runs as itself (`itself`): a run of one layer;
* layers run one by one (`one by one`), as the unconverted loop does, with
  the reason, which a `LayerByLayerWarning` gives.

A run ends where the loop does more than hand a layer's output to the next
layer (it changes it, or passes other arguments of another form), where
the stored segments end, and around a layer that writes entries of a
mapping every layer gets (`shared_mappings`). Layers that set attributes
on their own modules (state their next call, or their backward, reads:
`layer_state`) run one by one, each keeping its own; a layer with hooks of
its own (`addressed`) runs as itself. The whole call runs
one by one when the dry run
did not complete, read a tensor's value while looping (which layers run
could then change from call to call), or called the layers out of order.
"""
from __future__ import annotations

import dataclasses

from torch import Tensor

from torch_xla_ext.layer_stack.call_leaves import (Leaf, called_otherwise, fits, handed_pairs,
                                                   leaf_plans, takes_handed)
from torch_xla_ext.layer_stack.dry_run import CallRecord, RecordedCall
from torch_xla_ext.layer_stack.kinds import program_of
from torch_xla_ext.layer_stack.layer_state import attributes_restored
from torch_xla_ext.layer_stack.lifted_numbers import LiftedNumbers, differing
from torch_xla_ext.layer_stack.segments import plan_segments
from torch_xla_ext.layer_stack.shared_mappings import is_shared_mapping

__all__ = ["CallPlan", "Leaf", "Run", "plan_calls"]

SCAN, ITSELF, ONE_BY_ONE = "scan", "itself", "one by one"


@dataclasses.dataclass(frozen=True)
class Run:
    """Layers start, ..., stop - 1 of the list (see the module docstring)."""
    start: int
    stop: int
    segment: int  # the stored segment they are in
    how: str
    reason: str | None = None  # why one by one
    period: int = 1  # layers per scan step
    trigger: int = 0  # the layer whose call runs the scan
    # Per position in a step: how each argument leaf is given (a scan only).
    leaves: tuple[tuple[Leaf, ...], ...] = ()
    # Per position: which output leaves the forward uses beyond handing them on.
    kept: tuple[tuple[int, ...], ...] = ()
    # Per position: the form of a layer's output, and where each of its leaves comes from.
    outputs: tuple[tuple, ...] = ()
    # The Python numbers that differ between the layers, as per-layer operands
    # of the scan (`lifted_numbers`), or None.
    numbers: LiftedNumbers | None = None

    def handed_outputs(self) -> frozenset[int]:
        """The leaves of a layer's output that the next layer gets (`handed`)."""
        return frozenset(leaf.output for each in self.leaves for leaf in each
                         if leaf.kind == "handed")

    def __str__(self) -> str:
        return f"layers {self.start}-{self.stop - 1}" if self.stop - self.start > 1 \
            else f"layer {self.start}"


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """How one kind of call of one stacked list runs."""
    runs: tuple[Run, ...]
    reason: str | None = None  # why every layer runs one by one
    # Layer index -> its run, made with the plan: each call of a layer asks it.
    run_at: dict[int, Run] = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "run_at", {index: run for run in self.runs
                                            for index in range(run.start, run.stop)})


def plan_calls(stack, calls: list[RecordedCall], record: CallRecord) -> CallPlan:
    """The plan of the calls the dry run recorded for `stack` (a
    `StackedList`) in `record`."""
    if record.failure is not None:
        return CallPlan((), record.failure)
    if record.read is not None:
        return CallPlan((), (
            f"the forward reads a tensor's value while it loops over the layers "
            f"({record.read}), so which layers run, or how, can change from call to call, "
            f"which one scan cannot follow (LayerDrop while training skips layers at random: "
            f"set the config's layerdrop to 0.0)"))
    indices = [call.index for call in calls]
    if not indices:
        return CallPlan(())
    if indices != list(range(indices[0], indices[0] + len(indices))):
        return CallPlan((), f"the forward calls the layers {indices}, not each once in order")
    runs = []
    for number, segment in enumerate(stack.plan):
        start, stop = max(segment.start, indices[0]), min(segment.stop, indices[-1] + 1)
        if start < stop:
            runs += _runs(stack, number, segment, calls[start - indices[0]:stop - indices[0]],
                          record)
    return CallPlan(tuple(runs))


def _runs(stack, number: int, segment, calls: list[RecordedCall], record: CallRecord) -> list:
    """The runs of the calls of one stored segment's layers: a run ends
    where a call does not continue it (`_continues`), and alike layers that
    end up as runs of one for it run one by one, with the reason; a segment
    of groups of several layers is one run of whole groups, or runs one by
    one."""
    period = segment.period
    first, last = calls[0].index, calls[-1].index + 1
    if segment.single:
        return [Run(first, last, number, ITSELF)]
    hooked = set(stack.hooked_layers()).intersection(range(first, last))
    if hooked:
        return _around_hooked(stack, number, segment, calls, record, hooked)
    if period > 1:
        if (first - segment.start) % period or (last - first) % period:
            return [Run(first, last, number, ONE_BY_ONE,
                        f"{segment} run as one scan over groups of {period} layers, and the "
                        f"forward calls layers {first}-{last - 1}, not whole groups")]
        keeper = next((call for call in calls if call.attributes), None)
        if keeper is not None:
            return [Run(first, last, number, ONE_BY_ONE, _keeps_state(keeper))]
        writer = next((call for call in calls if call.writes), None)
        if writer is not None:
            return [Run(first, last, number, ONE_BY_ONE,
                        f"{segment} run as one scan over groups of {period} layers, and layer "
                        f"{writer.index} {_WRITES}")]
        otherwise = next((called_otherwise(calls[offset - period], calls[offset - 1],
                                           calls[offset])
                          for offset in range(period, len(calls))
                          if not _continues(calls[offset - period], calls[offset - 1],
                                            calls[offset])), None)
        if otherwise is not None:
            return [Run(first, last, number, ONE_BY_ONE,
                        f"{segment} run as one scan over groups of {period} layers, and "
                        f"{otherwise}")]
        if any(call.program != calls[offset % period].program
               for offset, call in enumerate(calls)):
            return [Run(first, last, number, ONE_BY_ONE,
                        f"{segment} run as one scan over groups of {period} layers, and the "
                        f"layers at the same position of two groups compute differently "
                        f"(their settings differ)")]
        return [_run(calls, number, period, record)]
    runs, begin, apart = [], 0, {}  # apart: why a layer was called otherwise, by index
    for offset in range(1, len(calls) + 1):
        if offset < len(calls) and _continues(calls[begin], calls[offset - 1], calls[offset]) \
                and takes_handed(calls[begin], calls[offset - 1], calls[offset]):
            continue
        runs += _by_program(stack, calls[begin:offset], number, record)
        if offset < len(calls):
            apart[calls[offset].index] = called_otherwise(calls[begin], calls[offset - 1],
                                                          calls[offset])
        begin = offset
    return _split_apart(_keeping_state(runs, calls), calls, record, apart)


def _around_hooked(stack, number: int, segment, calls: list[RecordedCall], record: CallRecord,
                   hooked: set[int]) -> list[Run]:
    """The runs of a segment's calls where some layers have hooks of their
    own (`addressed`): each layer of a group holding one runs as itself, so
    that its hooks run as unconverted, and the groups between them are
    planned as any calls."""
    runs, begin = [], 0
    for offset in range(0, len(calls) + 1, segment.period):
        group = calls[offset:offset + segment.period]
        if group and not hooked.intersection(call.index for call in group):
            continue
        if begin < offset:
            runs += _runs(stack, number, segment, calls[begin:offset], record)
        runs += [Run(call.index, call.index + 1, number, ITSELF) for call in group]
        begin = offset + segment.period
    return runs


def _keeping_state(runs: list[Run], calls: list[RecordedCall]) -> list[Run]:
    """The runs, with those of layers that set attributes on their own
    modules marked as run one by one (consecutive ones as one run, one
    warning)."""
    by_index = {call.index: call for call in calls}
    marked, keeping = [], None  # the last run marked here
    for run in runs:
        keeper = next((by_index[index] for index in range(run.start, run.stop)
                       if by_index[index].attributes), None)
        if keeper is not None:
            if marked and marked[-1] is keeping and keeping.stop == run.start:
                marked[-1] = keeping = dataclasses.replace(keeping, stop=run.stop)
                continue
            run = keeping = dataclasses.replace(run, how=ONE_BY_ONE,
                                                reason=run.reason or _keeps_state(keeper))
        marked.append(run)
    return marked


def _keeps_state(call: RecordedCall) -> str:
    return (f"layer {call.index} sets its attributes {list(call.attributes)} while it runs, "
            f"which a scan's steps cannot keep per layer: such layers run one by one, each "
            f"keeping its own, as unconverted")


def _split_apart(runs: list[Run], calls: list[RecordedCall], record: CallRecord,
                 apart: dict[int, str | None]) -> list[Run]:
    """The runs, with those of one layer that the forward split from the one
    before marked as run one by one (the layers would otherwise run as one
    scan): by working on what a layer returned before the next layer gets it
    (the reason names the line that did), or by calling it otherwise
    (`apart`, from `call_leaves.called_otherwise`)."""
    by_index = {call.index: call for call in calls}
    marked = []
    for run in runs:
        before = by_index.get(run.start - 1)
        line = (record.used.get(id(before.outputs[0]))
                if before is not None and before.outputs and run.how == ITSELF else None)
        given = by_index[run.start].leaves
        reason = (apart[run.start]
                  if run.how == ITSELF and apart.get(run.start) else None)
        if line is not None and not (given and given[0] is before.outputs[0]):
            reason = (f"the forward works on what layer {run.start - 1} returned before layer "
                      f"{run.start} gets it ({line}), and a scan runs the layers with nothing "
                      f"between them; move that work before or after the loop, or call a "
                      f"torch_xla_ext.LayerStack from your own forward")
        if reason is not None:
            previous = marked[-1] if marked else None
            if (previous is not None and previous.how in (ITSELF, ONE_BY_ONE)
                    and previous.stop == run.start):
                # The layers this work separates run one by one, one warning for them all.
                marked[-1] = dataclasses.replace(previous, stop=run.stop, how=ONE_BY_ONE,
                                                 reason=previous.reason or reason)
                continue
            run = dataclasses.replace(run, how=ONE_BY_ONE, reason=reason)
        marked.append(run)
    return marked


def _by_program(stack, calls: list[RecordedCall], number: int, record: CallRecord
                ) -> list[Run]:
    """The runs of consecutive calls alike: one scan where the layers compute
    one program (whatever settings tell their kinds apart), else the
    segments of their programs' pattern (`segments.plan_segments`): runs of
    one program, and repeating patterns scanned a group of layers per step.
    Layers whose programs differ only in Python numbers of their arithmetic
    compute one program given those numbers: one scan that takes them as
    per-layer operands (`_lifted`). Layers whose program none of their
    neighbours shares run one by one, with the settings that set them apart
    as the reason."""
    programs = [call.program for call in calls]
    if len(set(programs)) == 1:
        return [_run(calls, number, 1, record)]
    numbers = _lifted(stack, calls)
    if numbers is not None:
        run = _run(calls, number, 1, record)
        return [dataclasses.replace(run, numbers=numbers) if run.how == SCAN else run]
    kinds = [programs.index(program) for program in programs]
    runs = []
    for segment in plan_segments(kinds):
        run = _run(calls[segment.start:segment.stop], number, segment.period, record)
        if segment.single and runs and runs[-1].how in (ITSELF, ONE_BY_ONE) \
                and runs[-1].stop == run.start and runs[-1].reason in (None, _APART):
            runs[-1] = dataclasses.replace(runs[-1], stop=run.stop, how=ONE_BY_ONE,
                                           reason=_APART)
        else:
            runs.append(run)
    first, last = calls[0].index, calls[-1].index + 1
    settings = ", ".join(stack.differing_settings(first, last)) or "none"
    return [dataclasses.replace(run, reason=f"layers {run.start}-{run.stop - 1} compute "
                                            f"differently from each other, which one trace "
                                            f"cannot stand for (the settings that differ "
                                            f"between layers {first}-{last - 1}: {settings})")
            if run.reason is _APART else run for run in runs]


def _lifted(stack, calls: list[RecordedCall]) -> LiftedNumbers | None:
    """The numbers that differ between the calls, where the layers' programs
    traced again with those numbers as inputs are one (`lifted_numbers`),
    else None. Not for calls given a mapping every layer gets: after the dry
    run it no longer holds what the layers found in it."""
    numbers = differing([call.numbers for call in calls])
    if numbers is None or any(is_shared_mapping(leaf) for call in calls for leaf in call.leaves):
        return None
    programs = {}  # per kind of layer and program traced with the numbers as constants
    for call in calls:
        key = (stack.call_kind(call.index), call.program)
        if key not in programs:
            layer = stack.built_layer(call.index)  # as the dry run traces it
            with attributes_restored(layer):
                programs[key] = program_of(layer, stack.as_traced(call.leaves), call.spec,
                                           numbers)[0]
    return numbers if len(set(programs.values())) == 1 else None


# The reason of consecutive layers whose programs differ, until it is written out.
_APART = "compute differently"

# Why a layer that writes entries of a mapping every layer gets runs outside a scan.
_WRITES = ("writes entries of a mapping that every layer gets, and a scan's layers all see "
           "the mapping as it was before the scan")


def _continues(reference: RecordedCall, before: RecordedCall, call: RecordedCall) -> bool:
    """Whether `call` can be a later step of the scan whose first call at
    its position was `reference` (`call_leaves.called_otherwise`). A layer
    that writes entries of a mapping every layer gets is a run of its own:
    the entries there at a layer's call count as read by it
    (`shared_mappings`); so is one that sets attributes on its own modules
    (`layer_state`)."""
    return (not before.writes and not call.writes and not before.attributes
            and not call.attributes and called_otherwise(reference, before, call) is None)


def _run(calls: list[RecordedCall], number: int, period: int, record: CallRecord) -> Run:
    first, last = calls[0].index, calls[-1].index + 1
    if len(calls) == 1:
        return Run(first, last, number, ITSELF)
    reason = _unscannable(calls, period)
    if reason is not None:
        return Run(first, last, number, ONE_BY_ONE, reason)
    handed = handed_pairs(calls[0], calls[1]) if period == 1 else ()
    leaves = tuple(leaf_plans(calls[position::period], handed) for position in range(period))
    # The last layer's hidden state and handed values are the scan's results;
    # any other output the forward uses, or hands a layer of another run, it
    # takes from what the scan stacks per layer.
    needed = _taken_outside(calls, record) | record.used.keys()
    results = {0} | {output for _, output in handed}
    kept = tuple(tuple(sorted({leaf for call in calls[position::period]
                               for leaf, (output, source)
                               in enumerate(zip(call.outputs, call.sources))
                               if source.kind == "computed" and id(output) in needed
                               and not (call is calls[-1] and leaf in results)}))
                 for position in range(period))
    outputs = tuple((call.output_spec, call.sources) for call in calls[:period])
    # The call by which every variant of every chosen argument has been given.
    trigger = first + max([period - 1] + [
        leaf.choice.index(variant) * period + position
        for position, position_leaves in enumerate(leaves)
        for leaf in position_leaves if leaf.kind == "chosen" for variant in set(leaf.choice)])
    if any(kept) and period > 1:
        return Run(first, last, number, ONE_BY_ONE,
                   "the forward keeps each layer's output, and the scan over groups of layers "
                   "stacks the groups' last hidden states only")
    if any(kept) and trigger > first:
        return Run(first, last, number, ONE_BY_ONE,
                   "the forward keeps each layer's output, and the layers' arguments are only "
                   "all known at a later layer's call")
    return Run(first, last, number, SCAN, None, period, trigger, leaves, kept, outputs)


def _taken_outside(calls: list[RecordedCall], record: CallRecord) -> set[int]:
    """ids of what layer calls other than `calls` get past their hidden state."""
    inside = {id(call) for call in calls}
    return {id(leaf) for each in record.calls.values() for call in each
            if id(call) not in inside for leaf in call.leaves[1:]}


def _unscannable(calls: list[RecordedCall], period: int) -> str | None:
    """Why the run's calls cannot be one scan, or None."""
    for call in calls[:period]:
        if not call.leaves or not isinstance(call.leaves[0], Tensor):
            return (f"layer {call.index} is called without a tensor as its first argument, "
                    f"which a scan carries from layer to layer")
        kinds = [source.kind for source in call.sources]
        if kinds[:1] != ["computed"]:
            return (f"layer {call.index} gives back no tensor of its own as its first value, "
                    f"which a scan carries to the next layer")
        if "object" in kinds:
            what = call.sources[kinds.index("object")].value
            return (f"layer {call.index} gives back a {what} it makes, which a scan "
                    f"cannot carry or stack")
    handed = [handed_pairs(before, call) for before, call in zip(calls, calls[1:])]
    if period > 1:
        given = next(((call, pairs) for call, pairs in zip(calls[1:], handed) if pairs), None)
        if given is not None:
            return (f"layer {given[0].index} gets, as its argument leaf {given[1][0][0]}, a "
                    f"value the layer before it computed besides its hidden state, and a scan "
                    f"over groups of layers carries the hidden state only")
        return None
    for call, pairs in zip(calls[2:], handed[1:]):
        if pairs != handed[0]:
            return (f"layer {call.index} gets values that the layer before it computed, "
                    f"besides its hidden state, as (argument leaf, output leaf) {list(pairs)}, "
                    f"and layer {calls[1].index} as {list(handed[0])}, and a scan carries the "
                    f"same values from layer to layer")
    for position, output in handed[0] if handed else ():
        if not fits(calls[0].leaves[position], calls[0].sources[output]):
            return (f"layer {calls[0].index} gets, as its argument leaf {position}, no tensor "
                    f"of the shape and dtype of the value the next layers get there from the "
                    f"layer before them, which a scan carries")
    return None
