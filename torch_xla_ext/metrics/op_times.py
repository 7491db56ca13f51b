"""Where an execution's time goes, op by op: read from a profiler trace.

XLA:CPU runs a compiled graph as a sequence of ops (thunks: a fused kernel, a
matrix product, a copy), several at once when they do not depend on each
other. Under a profiler session its runtime marks each op twice in the trace:
an event named after the HLO instruction when the op is launched, and one
named ``end: <instruction>`` when it completes (a matrix product runs on the
thread pool after its launch returns, so the launch event alone would miss
it). Pairing the two gives each op's span.

Each op counts under its kind, the instruction's name without its numbering
(``dynamic-slice_bitcast_fusion.3.clone`` is a
``dynamic-slice_bitcast_fusion``). A kind's *wall* time is its share of the
time during which any op ran: an instant when two ops run counts half to each,
so the kinds' wall times add up to the execution's busy time; how long one op
ran alone, and how long two or more ran at once, shows how much the runtime
could overlap. Control flow (``while``, ``conditional``, the ``call`` that
wraps a kernel split across threads) only holds other ops, which count
themselves.

Reading a trace needs neither torch nor torch_xla (``op_times``,
``read_trace_events``), so a trace saved elsewhere can be read anywhere;
``measure_op_times`` in ``metrics.live`` records one of the running process.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re
from typing import Iterable, Mapping

# Ops that only hold other ops, each traced on its own.
CONTAINER_KINDS = frozenset(["while", "conditional", "call"])
END_PREFIX = "end: "
_NUMBERING = re.compile(r"(\.(\d+|clone))+$")


class OpTimesError(ValueError):
    """A trace that holds no op spans (recorded on a device whose runtime does
    not mark ops this way, or around no execution)."""


@dataclasses.dataclass(frozen=True)
class OpKind:
    """The ops of one kind, per execution: how many ran, their share of the
    busy time (`wall_seconds`) and their spans added up (`busy_seconds`,
    more than the wall time when they ran beside other ops)."""
    count: float
    wall_seconds: float
    busy_seconds: float


@dataclasses.dataclass(frozen=True)
class OpTimes:
    """Per execution: the time any op ran, each kind's part of it (largest
    wall time first), and how long exactly n ops ran at once (by n)."""
    busy_seconds: float
    kinds: Mapping[str, OpKind]
    concurrency: Mapping[int, float]


def check_executions(executions) -> None:
    """`executions` as op times take it: a whole number, 1 or more."""
    if isinstance(executions, bool) or not isinstance(executions, int) or executions < 1:
        raise ValueError(f"executions must be a whole number of executions, 1 or more, got "
                         f"{executions!r}")


def op_kind(instruction: str) -> str:
    """An HLO instruction's name without its numbering: `copy.124` is a `copy`."""
    return _NUMBERING.sub("", instruction)


def read_trace_events(directory: str) -> list[dict]:
    """The events of the newest trace (`*.trace.json.gz`) that the profiler
    saved under `directory` (`torch_xla.debug.profiler.stop_trace`)."""
    paths = glob.glob(os.path.join(glob.escape(directory), "**", "*.trace.json.gz"),
                      recursive=True)
    if not paths:
        raise OpTimesError(f"{directory}: holds no profiler trace (*.trace.json.gz)")
    with gzip.open(max(paths, key=os.path.getmtime), "rt", encoding="utf-8") as file:
        trace = json.load(file)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def op_spans(events: Iterable[Mapping]) -> list[tuple[float, float, str]]:
    """(start, end, instruction) of each op, times in the trace's microseconds.

    An instruction's launches and completions pair up in time order: the
    runtime never runs one instruction twice at once (a loop's iterations
    follow one another)."""
    starts, ends = collections.defaultdict(list), collections.defaultdict(list)
    for event in events:
        if event.get("ph") != "X":
            continue
        name = event["name"]
        if name.startswith(END_PREFIX):
            ends[name[len(END_PREFIX):]].append(event["ts"])
        else:
            starts[name].append(event["ts"])
    spans = []
    for instruction, completions in ends.items():
        spans += [(start, end, instruction)
                  for start, end in zip(sorted(starts[instruction]), sorted(completions))]
    return sorted(spans)


def op_times(events: Iterable[Mapping], executions: int = 1) -> OpTimes:
    """The ops of a trace's events, per execution of `executions` recorded."""
    check_executions(executions)
    spans = [(start, end, op_kind(instruction)) for start, end, instruction in op_spans(events)
             if op_kind(instruction) not in CONTAINER_KINDS]
    if not spans:
        raise OpTimesError(
            "the trace holds no op spans (launch and 'end: ' events of XLA:CPU's runtime): no "
            "op ran while it was recorded (a function that builds no graph, or whose results "
            "nobody holds), or it was recorded on another device than PJRT's CPU; on a TPU, "
            "read the profiler's own device trace (TensorBoard's profile plugin)")
    counts, busy = collections.Counter(), collections.Counter()
    for start, end, kind in spans:
        counts[kind] += 1
        busy[kind] += end - start
    wall, concurrency = _shared_wall(spans)
    per_execution = 1e-6 / executions  # microseconds to seconds
    kinds = {kind: OpKind(counts[kind] / executions, wall[kind] * per_execution,
                          busy[kind] * per_execution)
             for kind in sorted(counts, key=lambda kind: -wall[kind])}
    return OpTimes(sum(wall.values()) * per_execution, kinds,
                   {n: concurrency[n] * per_execution for n in sorted(concurrency)})


def _shared_wall(spans: list[tuple[float, float, str]]
                 ) -> tuple[collections.Counter, collections.Counter]:
    """Each kind's share of the time any (start, end, kind) span covers (an
    interval covered by n spans counts 1/n to the kind of each), and the time
    covered by exactly n spans, by n."""
    # At one instant, spans end before others start; empty spans cover nothing.
    lasting = [index for index, (start, end, _) in enumerate(spans) if end > start]
    boundaries = sorted([(spans[index][0], 1, index) for index in lasting]
                        + [(spans[index][1], -1, index) for index in lasting])
    wall, concurrency = collections.Counter(), collections.Counter()
    running: set[int] = set()
    previous = None
    for time, change, index in boundaries:
        if running and time > previous:
            concurrency[len(running)] += time - previous
            share = (time - previous) / len(running)
            for active in running:
                wall[spans[active][2]] += share
        previous = time
        if change > 0:
            running.add(index)
        else:
            running.discard(index)
    return wall, concurrency
