"""What the benchmark scripts share: their workers, their command line, their
timed steps, their ratios against goals and their tables.

Each measurement runs in a fresh Python process, because torch_xla's metrics,
compilation cache and peak memory belong to a process. The parent calls
`run_worker(script, arguments, time_limit)`, which runs
`python script arguments...` and waits at most `time_limit` seconds; the
worker measures (`time_steps`), then calls `report_result(figures)`, which
prints the figures as one JSON line marked with RESULT_PREFIX (the workload may
print lines of its own) and returns. The parent gets an `Outcome`: the
figures, or, for a worker that failed, printed no result or ran out of time, a
status for the table and the end of the worker's output.

Importing this module sets PJRT_DEVICE to CPU unless the user chose a device,
so a script imports it before anything imports torch_xla (which would choose a
device of its own, a TPU where it finds one); workers inherit the choice. It
imports nothing but the standard library (its functions import the parts of
torch_xla_ext.metrics that need no torch), so that a worker starts no slower
for it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

DEFAULT_DEVICE = "CPU"
os.environ.setdefault("PJRT_DEVICE", DEFAULT_DEVICE)

# XLA:CPU keeps each compiled graph's kernels in memory mappings of their own
# (about three a kernel; a graph of a few layers has hundreds), and torch_xla
# keeps its compiled graphs: the test suite and the peer suites compile
# thousands, and at Linux's limit of 65530 mappings (vm.max_map_count) a
# process dies in its next mmap ("LLVM compilation error: Cannot allocate
# memory", or a segfault). Keeping the last 128 graphs bounds the mappings.
COMPILATION_CACHE_SIZE = "128"
# Their time is XLA:CPU compiling thousands of tiny graphs. Three settings
# change how fast a kernel is compiled or runs, not what it computes: no LLVM
# optimizations, and fusions emitted by XLA:CPU's elemental emitter instead of
# its MLIR fusion emitters (slow to compile), cut that time about threefold;
# one LLVM module per graph instead of parts compiled in threads of their own
# (each worker has one core: the threads only contend) another eighth. XLA's
# HLO passes, which the HLO tests read, still run.
FAST_COMPILATION_FLAGS = ("--xla_backend_optimization_level=0",
                          "--xla_cpu_use_fusion_emitters=false",
                          "--xla_cpu_parallel_codegen_split_count=1")


def compile_fast() -> None:
    """FAST_COMPILATION_FLAGS and the cache bound, in this process's
    environment (its workers inherit them); a caller's own setting of each wins.
    For correctness runs (tests, peer suites), never for timed benchmarks."""
    os.environ.setdefault("XLA_COMPILATION_CACHE_SIZE", COMPILATION_CACHE_SIZE)
    for flag in FAST_COMPILATION_FLAGS:
        if flag.partition("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), flag]))


RESULT_PREFIX = "benchmark worker result: "
OUTPUT_TAIL_LINES = 25
# Executions each run records for --op-times, and the kinds of op listed (the
# others are summed).
OP_TIMES_EXECUTIONS = 2
OP_KINDS_SHOWN = 14
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
        returncode = process.returncode
    except subprocess.TimeoutExpired:
        _stop(process)
        stdout, stderr = process.communicate()
        returncode = None
    except BaseException:  # Ctrl-C reaches only this process: the worker must not linger
        _stop(process)
        process.wait()
        raise
    return worker_outcome(returncode, stdout, stderr, time.perf_counter() - started, limit)


def worker_outcome(returncode: int | None, stdout: str, stderr: str, seconds: float,
                   limit: float) -> Outcome:
    """What a worker that ended with `returncode` gave, or, with None, one
    stopped at its time limit of `limit` seconds."""
    tail = _tail(stderr) or _tail(stdout)
    if returncode is None:
        return Outcome(None, f"timed out after {limit:g} s", tail, seconds)
    results = [line[len(RESULT_PREFIX):] for line in stdout.splitlines()
               if line.startswith(RESULT_PREFIX)]
    if returncode != 0:
        return Outcome(None, _exit_status(returncode), tail, seconds)
    if not results:
        return Outcome(None, "no result printed", tail, seconds)
    return Outcome(json.loads(results[-1]), OK, tail, seconds)


def measure(script: str, arguments: Sequence[str], limit: float, label: str) -> Outcome:
    """`run_worker`, printing how it went: the end of the output of a worker
    that failed, then the worker's wall time."""
    outcome = run_worker(script, arguments, limit)
    if not outcome.ok:
        print(outcome.failure_report(f"  {label}"), flush=True)
    print(f"  ran {label} in {outcome.seconds:.0f} s", flush=True)
    return outcome


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


def outcome_table(outcomes: Mapping[str, Outcome], rows: Sequence, baseline: str | None,
                  markdown: bool = False) -> str:
    """`torch_xla_ext.metrics.format_table` of the workers' figures (a markdown
    table with `markdown`); when a worker gave none, a first row gives each
    worker's status and that worker's figures show as `-`."""
    from torch_xla_ext.metrics import COUNT, Row, format_table

    if any(not outcome.ok for outcome in outcomes.values()):
        rows = (Row(STATUS_KEY, "worker process", COUNT), *rows)
    return format_table(outcome_columns(outcomes), baseline=baseline, rows=rows,
                        markdown=markdown)


def exit_on_problems(prog: str, problems: Sequence[str | None]) -> None:
    """Ends the script with exit code 1 and `prog: error: ...` naming the
    problems (None is none), if there are any."""
    problems = [problem for problem in problems if problem]
    if problems:
        sys.exit(f"{prog}: error: {'; '.join(problems)}")


# ---------------------------------------------------------------- command line


def benchmark_parser(script: str, description: str) -> argparse.ArgumentParser:
    """The parser of a benchmark script: named after `script` (also when its
    main() is called from elsewhere), `description` (its docstring) as written,
    with --markdown."""
    parser = argparse.ArgumentParser(prog=os.path.basename(script), description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_markdown_option(parser)
    return parser


def add_markdown_option(parser: argparse.ArgumentParser) -> None:
    """--markdown: the script's tables as GitHub markdown tables."""
    parser.add_argument("--markdown", action="store_true",
                        help="print the tables (runs, ratios against their goals) as GitHub "
                             "markdown tables instead of aligned text")


def add_layer_and_mode_options(parser: argparse.ArgumentParser, modes: Sequence[str]) -> None:
    """--layers, --modes and --quick of a script that measures each of `modes`
    at each depth, and the worker's --mode."""
    parser.add_argument("--layers", default=None,
                        help="comma-separated layer counts (default 8,32,64; one int in --worker)")
    parser.add_argument("--modes", default=",".join(modes), help="comma-separated modes")
    parser.add_argument("--quick", action="store_true", help="layer counts 2,4 only")
    parser.add_argument("--mode", choices=modes, help=argparse.SUPPRESS)


def add_timeout_option(parser: argparse.ArgumentParser, default: float, run: str) -> None:
    """--timeout: the time limit of each worker, a `run` ("mode", "policy", ...)."""
    parser.add_argument("--timeout", type=time_limit, default=default, metavar="SECONDS",
                        help=f"time limit of each {run}'s process (default {default:g}); "
                             f"a {run} that exceeds it is reported as timed out")


def positive_int(text: str) -> int:
    """argparse type of a count: a whole number, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be 1 or more")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type of comma-separated counts, each a whole number of at
    least 1; a count given twice is measured once."""
    return list(dict.fromkeys(positive_int(part) for part in text.split(",")))


def add_rounds_option(parser: argparse.ArgumentParser) -> None:
    """--rounds: how many times every (mode, L) runs, round after round."""
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="times each (mode, L) runs, round after round; ratios are the "
                             "rounds' median, printed with their spread (default 1)")


def add_worker_options(parser: argparse.ArgumentParser, default_timeout: float,
                       run: str = "run") -> None:
    """--timeout, and --worker, with which the script is one of its own workers."""
    add_timeout_option(parser, default_timeout, run)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


# The sizes of the LlamaForCausalLM the transformers benchmarks build.
LLAMA_SIZE_OPTIONS = ("hidden", "heads", "kv_heads", "intermediate", "vocab")


def add_llama_size_options(parser: argparse.ArgumentParser) -> None:
    """--hidden, --heads, --kv-heads, --intermediate, --vocab of the model."""
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=1024)


def llama_description(args: argparse.Namespace) -> str:
    """The model's sizes, for the line a script prints first."""
    return (f"LlamaForCausalLM hidden {args.hidden}, {args.heads} heads, {args.kv_heads} "
            f"key/value heads, intermediate {args.intermediate}, vocab {args.vocab}")


def llama_config(args: argparse.Namespace, **settings):
    """The LlamaConfig of `args.layers` layers at the sizes of `args`."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, **settings)


def chosen_runs(parser: argparse.ArgumentParser, args: argparse.Namespace,
                modes: Sequence[str], warmup_steps: int | None) -> tuple[list[int], list[str]]:
    """The depths and modes that --layers (or --quick) and --modes choose, once
    --steps is known to leave steady steps after the `warmup_steps` (None: a
    script that runs no steps)."""
    if warmup_steps is not None and args.steps <= warmup_steps:
        parser.error(f"--steps must exceed the {warmup_steps} warm-up steps")
    layer_counts = [int(n) for n in (args.layers or ("2,4" if args.quick else "8,32,64"))
                    .split(",")]
    chosen = args.modes.split(",")
    unknown = sorted(set(chosen) - set(modes))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(modes)}")
    return layer_counts, chosen


def passed_on(args: argparse.Namespace, options: Sequence[str]) -> list[str]:
    """The worker's command-line arguments that give it `options` (attribute
    names of `args`) as the parent has them; an option that is None or False
    is left out, a flag that is True given alone."""
    arguments = []
    for option in options:
        value = getattr(args, option)
        flag = f"--{option.replace('_', '-')}"
        if value is True:
            arguments.append(flag)
        elif value is not None and value is not False:
            arguments += [flag, str(value)]
    return arguments


def mode_option(mode: str) -> list[str]:
    """A worker's arguments that choose `mode`."""
    return ["--mode", mode]


def measure_modes_and_depths(script: str, modes: Sequence[str], layer_counts: Sequence[int],
                             arguments: Sequence[str], limit: float,
                             mode_arguments: Callable[[str], Sequence[str]] = mode_option
                             ) -> dict[tuple[str, int], Outcome]:
    """Runs `script --worker MODE_ARGUMENTS --layers L arguments...` for each
    depth and mode, in that order, each in a fresh process (`measure`);
    `mode_arguments(mode)` gives a mode's arguments (`--mode MODE`, or more for
    a mode that is a variant of another)."""
    return {(mode, layers): measure(script, ["--worker", *mode_arguments(mode), "--layers",
                                             str(layers), *arguments], limit, f"{mode} L={layers}")
            for layers in layer_counts for mode in modes}


def measure_rounds(script: str, modes: Sequence[str], layer_counts: Sequence[int],
                   arguments: Sequence[str], limit: float, rounds: int, heading: str,
                   print_table: Callable[[Mapping[tuple[str, int], Outcome]], None],
                   mode_arguments: Callable[[str], Sequence[str]] = mode_option
                   ) -> list[dict[tuple[str, int], Outcome]]:
    """`rounds` rounds of `measure_modes_and_depths`, each round's table printed
    by `print_table` under `heading` (with the round's number when there are
    several); returns every round's outcomes."""
    every_round = []
    for number in range(1, rounds + 1):
        outcomes = measure_modes_and_depths(script, modes, layer_counts, arguments, limit,
                                            mode_arguments)
        print(f"\n{heading}" + (f", round {number} of {rounds}" if rounds > 1 else ""))
        print_table(outcomes)
        every_round.append(outcomes)
    return every_round


def figures_by_run(outcomes: Mapping[tuple[str, int], Outcome]) -> dict[tuple[str, int], dict]:
    """The figures of each (mode, L) that gave them."""
    return {key: outcome.figures for key, outcome in outcomes.items() if outcome.ok}


def exit_if_runs_failed(prog: str, outcomes: Mapping[tuple[str, int], Outcome]) -> None:
    """Ends the script with `exit_on_problems` if any (mode, depth) gave no figures."""
    exit_on_problems(prog, [failure_summary(
        {f"{mode} L={layers}": outcome for (mode, layers), outcome in outcomes.items()})])


# ---------------------------------------------------------------- worker side


@dataclass(frozen=True)
class StepTimes:
    """Wall seconds of each step `time_steps` ran, split where its graph is built."""
    build: list[float]   # from the step's start until `build` returned
    finish: list[float]  # from then until `finish` returned
    # The process's CPU seconds (all its threads) over `finish`: the work the
    # device's execution did, which the machine's other tenants do not stretch
    # as they stretch wall time (CPU backend).
    finish_cpu: list[float]
    peak_is_last_steps: bool  # peak RSS restarted before the last step (reset_peak_rss)
    last_built: Any      # what the last step's `build` returned (its loss, say)

    @property
    def total(self) -> list[float]:
        return [build + finish for build, finish in zip(self.build, self.finish)]


def time_steps(steps: int, build: Callable[[], Any], finish: Callable[[], Any],
               prepare: Callable[[int], Any] = lambda step: None) -> StepTimes:
    """Runs `steps` steps, each `prepare(step_index)` untimed (releasing the
    previous step's gradients, say), then `build()` (the lazy graph) and
    `finish()` (running it to the end), timed apart.

    The peak RSS count restarts after the last step's `prepare`, so that
    `peak_rss_bytes()` read after this is the last step's own.
    """
    from torch_xla_ext.metrics import reset_peak_rss

    build_seconds, finish_seconds, finish_cpu_seconds = [], [], []
    peak_is_last_steps = False
    built = None
    for step in range(steps):
        prepare(step)
        if step == steps - 1:
            peak_is_last_steps = reset_peak_rss()
        started = time.perf_counter()
        built = build()
        built_at, cpu_at = time.perf_counter(), time.process_time()
        finish()
        build_seconds.append(built_at - started)
        finish_seconds.append(time.perf_counter() - built_at)
        finish_cpu_seconds.append(time.process_time() - cpu_at)
    return StepTimes(build_seconds, finish_seconds, finish_cpu_seconds, peak_is_last_steps, built)


# ---------------------------------------------------------------- ratios and tables


def ratio(figures: Mapping[Any, Mapping], numerator, denominator, figure: str) -> float | None:
    """figures[numerator][figure] / figures[denominator][figure]; None if either
    run is missing or the denominator is 0."""
    a, b = figures.get(numerator), figures.get(denominator)
    return a[figure] / b[figure] if a and b and b[figure] else None


def verdict(value: float, goal: float, minimum: bool = False) -> str:
    """Whether `value` meets a goal of at most `goal` (at least `goal`, with `minimum`)."""
    return "ok" if (value >= goal if minimum else value <= goal) else "MISSED"


def median_and_spread(values: Sequence[float | None]
                      ) -> tuple[float | None, tuple[float, float] | None]:
    """The median of the rounds' `values` and their (min, max) when there are
    several; (None, None) if a round lacks one (a missing run)."""
    if not values or any(value is None for value in values):
        return None, None
    spread = (min(values), max(values)) if len(values) > 1 else None
    return statistics.median(values), spread


def median_cell(values: Sequence[float | None], digits: int = 2) -> str:
    """The rounds' median of `values` as a table cell, with their spread
    (min-max) in brackets when there are several; "-" if a round lacks one."""
    value, spread = median_and_spread(values)
    if value is None:
        return "-"
    text = f"{value:.{digits}f}"
    return text + (f" ({spread[0]:.{digits}f}-{spread[1]:.{digits}f})" if spread else "")


@dataclass(frozen=True)
class Goal:
    """A ratio (or a count) and the most it should be (the least, with
    `minimum`): its value (None when a run it needs is missing) and, over
    several rounds, its spread (min, max)."""
    label: str
    value: float | None
    goal: float
    spread: tuple[float, float] | None = None
    minimum: bool = False


def goal_over_rounds(label: str, rounds: Sequence[Mapping[Any, Mapping]], numerator,
                     denominator, figure: str, goal: float) -> Goal:
    """The `Goal` of the median over `rounds` (each round's figures by run) of
    `ratio(numerator, denominator, figure)`, with its spread."""
    value, spread = median_and_spread([ratio(figures, numerator, denominator, figure)
                                       for figures in rounds])
    return Goal(label, value, goal, spread)


def goal_table(goals: Sequence[Goal], markdown: bool = False) -> str:
    """The goals' `goal_line`s, labels padded alike; with `markdown`, a markdown
    table instead: ratio, value (median when over rounds), spread, goal, verdict."""
    if not markdown:
        width = max(len(goal.label) for goal in goals)
        return "\n".join(goal_line(goal.label, goal.value, goal.goal, width, goal.spread,
                                   goal.minimum) for goal in goals)
    from torch_xla_ext.metrics.table import render_rows

    over_rounds = any(goal.spread for goal in goals)
    rows: list = [["ratio", "median" if over_rounds else "value",
                   *(["spread"] if over_rounds else []), "goal", "verdict"]]
    for goal in goals:
        if goal.value is None:
            rows.append([goal.label, "n/a (missing run)"])
            continue
        spread = f"{goal.spread[0]:.3f}-{goal.spread[1]:.3f}" if goal.spread else "-"
        rows.append([goal.label, f"{goal.value:.3f}", *([spread] if over_rounds else []),
                     f"{'>=' if goal.minimum else '<='} {goal.goal}",
                     verdict(goal.value, goal.goal, goal.minimum)])
    return render_rows(rows, markdown=True)


def goal_line(label: str, value: float | None, goal: float, width: int,
              spread: tuple[float, float] | None = None, minimum: bool = False) -> str:
    """A ratio's line: `label` padded to `width`, its value, its goal (at most
    `goal`; at least, with `minimum`) and the verdict, then the spread over
    rounds if given; n/a when a run it needs is missing (`value` None)."""
    if value is None:
        return f"  {label:<{width}} n/a (missing run)"
    line = (f"  {label:<{width}} {value:6.3f}   goal {'>=' if minimum else '<='} {goal:<5} "
            f"{verdict(value, goal, minimum)}")
    return line if spread is None else f"{line:<{width + 32}} ({spread[0]:.3f}-{spread[1]:.3f})"


def print_runs_table(outcomes: Mapping[tuple[str, int], Outcome],
                     columns: Sequence[tuple[str, Callable[[dict], str]]],
                     markdown: bool = False) -> None:
    """A line per (mode, L) (a markdown table with `markdown`): each column's
    text made from the run's figures by its function, or the status of a run
    that gave none."""
    from torch_xla_ext.metrics.table import render_rows

    rows: list = [["mode", "L", *(header for header, _ in columns)], None]
    for (mode, layers), outcome in outcomes.items():
        if outcome.figures is None:
            rows.append([mode, str(layers), outcome.status])
        else:
            rows.append([mode, str(layers), *(text(outcome.figures) for _, text in columns)])
    print(render_rows(rows, markdown))


def add_op_times_option(parser: argparse.ArgumentParser, recorded: str) -> None:
    """--op-times, which records OP_TIMES_EXECUTIONS more `recorded` (a plural)."""
    parser.add_argument("--op-times", action="store_true",
                        help=f"also record {OP_TIMES_EXECUTIONS} more {recorded} per run "
                             "under torch_xla's profiler and print where their time went, op "
                             "by op (PJRT CPU)")


def op_time_figures(run: Callable[[], Any]) -> dict:
    """The worker's side of --op-times: where OP_TIMES_EXECUTIONS calls of
    `run` (each synced) spent their time, per call (`metrics.measure_op_times`)."""
    from torch_xla_ext.metrics import measure_op_times

    recorded = measure_op_times(run, OP_TIMES_EXECUTIONS)
    return {"busy_ms": 1e3 * recorded.busy_seconds,
            "kinds": {kind: [ops.count, 1e3 * ops.wall_seconds]
                      for kind, ops in recorded.kinds.items()},
            "running_ms": {str(n): 1e3 * seconds
                           for n, seconds in recorded.concurrency.items()}}


def print_op_times(figures: Mapping[tuple[str, int], dict], markdown: bool = False) -> None:
    """Per kind of op, each run's count and wall ms (`op_time_figures`, in
    figure "op_times"), the kinds that took longest in any run first; the
    rest summed. Then the time one op ran alone, and two or more at once."""
    from torch_xla_ext.metrics.table import render_rows

    runs = {run: r["op_times"] for run, r in figures.items() if r.get("op_times")}
    if not runs:
        return
    longest: dict[str, float] = {}
    for recorded in runs.values():
        for kind, (_, wall_ms) in recorded["kinds"].items():
            longest[kind] = max(longest.get(kind, 0.0), wall_ms)
    shown = sorted(longest, key=lambda kind: -longest[kind])[:OP_KINDS_SHOWN]
    rows: list = [["op kind", *(f"{mode} L={layers} {what}" for mode, layers in runs
                                for what in ("n", "ms"))], None]
    for kind in shown:
        cells = []
        for recorded in runs.values():
            count, wall_ms = recorded["kinds"].get(kind, (0, 0.0))
            cells += [f"{count:.0f}", f"{wall_ms:.1f}"]
        rows.append([kind, *cells])
    other = [sum(wall_ms for kind, (_, wall_ms) in recorded["kinds"].items()
                 if kind not in shown) for recorded in runs.values()]
    rows.append(["other kinds", *(cell for ms in other for cell in ("", f"{ms:.1f}"))])
    rows.append(None)
    rows.append(["all ops (busy)", *(cell for recorded in runs.values()
                                     for cell in ("", f"{recorded['busy_ms']:.1f}"))])
    for label, counts in (("1 op running", lambda n: n == 1),
                          ("2 or more at once", lambda n: n >= 2)):
        rows.append([label, *(cell for recorded in runs.values() for cell in (
            "", f"{sum(ms for n, ms in recorded['running_ms'].items() if counts(int(n))):.1f}"))])
    print(render_rows(rows, markdown))


def print_layer_table(outcomes: Mapping[tuple[str, int], Outcome], markdown: bool = False) -> None:
    """A line per (mode, L) (a markdown table with `markdown`): its figures
    (first_step_s where measured, python_ms, compile_s, compiles, execute_ms,
    execute_cpu_ms, forward_ms and forward_cpu_ms where measured, peak_rss_mib,
    param_mib), or the status of a run
    that gave none."""
    forward = any(o.figures and "forward_ms" in o.figures for o in outcomes.values())
    first_step = any(o.figures and "first_step_s" in o.figures for o in outcomes.values())
    print_runs_table(outcomes, [
        *([("first step s", lambda r: f"{r['first_step_s']:.2f}")] if first_step else []),
        ("python ms", lambda r: f"{r['python_ms']:.2f}"),
        ("compile s", lambda r: f"{r['compile_s']:.2f}"),
        ("compiles", lambda r: str(r["compiles"])),
        ("exec ms", lambda r: f"{r['execute_ms']:.1f}"),
        ("exec cpu ms", lambda r: f"{r['execute_cpu_ms']:.1f}"),
        *([("fwd ms", lambda r: f"{r['forward_ms']:.1f}"),
           ("fwd cpu ms", lambda r: f"{r['forward_cpu_ms']:.1f}")] if forward else []),
        ("peak RSS MiB", lambda r: f"{r['peak_rss_mib']:.0f}"),
        ("params MiB", lambda r: f"{r['param_mib']:.1f}"
                                 + ("" if r["peak_is_steady"] else " (lifetime peak)")),
    ], markdown)
