"""The worker harness of the benchmark scripts (compare_metrics.py, bench_layers.py).

Each measurement runs in a fresh Python process, because torch_xla's metrics,
compilation cache and peak memory belong to a process. The parent calls
`run_worker(script, arguments, time_limit)`, which runs
`python script arguments...` and waits at most `time_limit` seconds; the
worker measures, then calls `report_result(figures)`, which prints the figures
as one JSON line marked with RESULT_PREFIX (the workload may print lines of its
own) and returns. The parent gets an `Outcome`: the figures, or, for a worker
that failed, printed no result or ran out of time, a status for the table and
the end of the worker's output.

Importing this module sets PJRT_DEVICE to CPU unless the user chose a device,
so a script imports it before anything imports torch_xla (which would choose a
device of its own, a TPU where it finds one); workers inherit the choice. It
imports nothing of torch itself, so that a worker starts no slower for it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

DEFAULT_DEVICE = "CPU"
os.environ.setdefault("PJRT_DEVICE", DEFAULT_DEVICE)

RESULT_PREFIX = "benchmark worker result: "
OUTPUT_TAIL_LINES = 25
OK = "ok"
# Each worker's status, in its table column and its JSON figures.
STATUS_KEY = "worker"


@dataclass(frozen=True)
class Outcome:
    """What one worker process gave: its figures, or why there are none."""
    figures: dict | None
    status: str        # OK, or what went wrong: "timed out after 300 s", "exit code 1", ...
    output_tail: str   # the last lines the worker wrote to stderr (stdout if none)
    seconds: float     # wall time of the worker process

    @property
    def ok(self) -> bool:
        return self.figures is not None

    def failure_report(self, what: str) -> str:
        """`what` (such as "mode 'scan'") and what went wrong, with the end of its output."""
        tail = self.output_tail or "(no output)"
        return f"{what}: {self.status}; the end of its output:\n{tail}"


def device_name() -> str:
    """The PJRT device the workers run on."""
    return os.environ["PJRT_DEVICE"]


def time_limit(text: str) -> float:
    """argparse type of a time limit: a positive number of seconds."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 seconds")
    return seconds


def run_worker(script: str, arguments: Sequence[str], limit: float) -> Outcome:
    """Runs `python script arguments...` in a fresh process for at most `limit` seconds."""
    started = time.perf_counter()
    # A session of its own, so that the whole process group can be stopped.
    process = subprocess.Popen(
        [sys.executable, script, *arguments], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=limit)
        timed_out = False
    except subprocess.TimeoutExpired:
        _stop(process)
        stdout, stderr = process.communicate()
        timed_out = True
    except BaseException:  # Ctrl-C reaches only this process: the worker must not linger
        _stop(process)
        process.wait()
        raise
    seconds = time.perf_counter() - started
    tail = _tail(stderr) or _tail(stdout)
    if timed_out:
        return Outcome(None, f"timed out after {limit:g} s", tail, seconds)
    results = [line[len(RESULT_PREFIX):] for line in stdout.splitlines()
               if line.startswith(RESULT_PREFIX)]
    if process.returncode != 0:
        return Outcome(None, _exit_status(process.returncode), tail, seconds)
    if not results:
        return Outcome(None, "no result printed", tail, seconds)
    return Outcome(json.loads(results[-1]), OK, tail, seconds)


def report_result(figures: Mapping) -> None:
    """The worker's side: prints `figures` for `run_worker` to read."""
    print(RESULT_PREFIX + json.dumps(figures), flush=True)


def _stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone


def _tail(text: str) -> str:
    return "\n".join(text.rstrip().splitlines()[-OUTPUT_TAIL_LINES:])


def _exit_status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def failure_summary(outcomes: Mapping[str, Outcome]) -> str | None:
    """One line naming the runs (keys of `outcomes`) that gave no figures; None if all did."""
    failed = [f"{name} ({outcome.status})" for name, outcome in outcomes.items() if not outcome.ok]
    if not failed:
        return None
    return f"{len(failed)} of {len(outcomes)} runs gave no figures: {', '.join(failed)}"


def outcome_columns(outcomes: Mapping[str, Outcome]) -> dict[str, dict]:
    """A column per worker for `format_table` (and JSON): its figures and its
    status; a worker without figures shows only its status."""
    return {name: {**(outcome.figures or {}), STATUS_KEY: outcome.status}
            for name, outcome in outcomes.items()}


def outcome_table(outcomes: Mapping[str, Outcome], rows: Sequence, baseline: str | None) -> str:
    """`torch_xla_ext.metrics.format_table` of the workers' figures; when a
    worker gave none, a first row gives each worker's status and that worker's
    figures show as `-`."""
    from torch_xla_ext.metrics import COUNT, Row, format_table

    if any(not outcome.ok for outcome in outcomes.values()):
        rows = (Row(STATUS_KEY, "worker process", COUNT), *rows)
    return format_table(outcome_columns(outcomes), baseline=baseline, rows=rows)
