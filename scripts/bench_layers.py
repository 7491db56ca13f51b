#!/usr/bin/env python
"""Benchmark a training step over L decoder blocks: for loop, LayerStack, torch_xla scan_layers.

Each (block, mode, L) runs in a fresh process (scripts/harness.py, within
--timeout seconds) on the device PJRT_DEVICE names, CPU if it is not set:
build the model (`torch_xla_ext.workloads`; `--block` chooses the layer: ours,
fused_qkv_sdpa, llama), run `--steps` training steps (forward, MSE loss,
backward, SGD), then as many forward-only steps (no gradients), and report

* python ms:  Python time of a steady step, from its start until just before
              `torch_xla.sync()` (building the lazy graph; the previous step's
              gradients are released before the timer starts),
* compile s:  XLA compile time over all steps (metric `CompileTime`, total),
* compiles:   number of XLA compilations over all steps,
* exec ms:    wall time of `torch_xla.sync()` + `wait_device_ops()` of a steady step,
* exec cpu ms: the process's CPU time (all threads) over the same span: the
              work done, which other tenants of a shared machine stretch far
              less than its wall time,
* fwd ms, fwd cpu ms: the same for a steady forward-only step,
* peak RSS:   peak resident memory during the last steady step (VmHWM after
              resetting it through /proc/self/clear_refs).

Steady steps are the ones after the first two; figures are their medians.
The compile figures are the training steps'. With `--rounds N` every
(mode, L) of a block runs N times, round after round; each ratio is then the
median of the rounds' ratios, printed with their spread (min-max). The summary
prints the ratios the layer-stack issues ask for.

With `--op-times`, each run then records two more training steps under
torch_xla's profiler, and the script prints, per block, where a step's time
went op by op in the last round (`torch_xla_ext.metrics.op_times`): each kind
of op's count and its share of the time any op ran, a column per run.

`--unroll 1,2,4` measures mode scan once for each number of layers per
iteration of the scan's loops (LayerStack's `unroll`; runs "scan unroll=k",
k = 1 being plain "scan"), and prints each one's execution and compile time
over the for loop's side by side.

  python scripts/bench_layers.py                 # L = 8, 32, 64
  python scripts/bench_layers.py --quick         # L = 2, 4: a quick check
  python scripts/bench_layers.py --memory        # 16 layers holding 1 GiB of weights
  python scripts/bench_layers.py --block ours,fused_qkv_sdpa,llama --modes loop,scan \\
      --layers 32 --rounds 3                     # issue 18's figures
  python scripts/bench_layers.py --modes loop,scan --layers 16 --unroll 1,2,4
  python scripts/bench_layers.py --block fused_qkv_sdpa --modes loop,scan --layers 32 \\
      --op-times                                 # where the step's time goes
"""
from __future__ import annotations

import os
import statistics

import harness  # first: it sets the default device before torch_xla is imported

MODES = ("loop", "scan", "torch-xla-scan")
WARMUP_STEPS = 2
# Seconds one (mode, L) may take: L=64 with torch_xla's scan_layers takes minutes.
DEFAULT_TIMEOUT = 1800
# The options a worker is given as the parent has them.
WORKLOAD_OPTIONS = ("steps", "hidden", "heads", "seq", "batch", "intermediate", "op_times")
BLOCKS = ("ours", "fused_qkv_sdpa", "llama")


def scan_run(unroll: int) -> str:
    """The name of mode scan's run with `unroll` layers per loop iteration."""
    return "scan" if unroll == 1 else f"scan unroll={unroll}"


def worker_modes(modes: list[str], unrolls: list[int]) -> dict[str, list[str]]:
    """Each run's name and the worker arguments that choose it, in the order of
    `modes`, scan once per unroll."""
    runs = {}
    for mode in modes:
        if mode == "scan":
            runs.update({scan_run(unroll): [*harness.mode_option(mode), "--unroll", str(unroll)]
                         for unroll in unrolls})
        else:
            runs[mode] = harness.mode_option(mode)
    return runs


def run_worker(args) -> dict:
    """One (mode, L) measurement in this process; returns the figures."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from torch_xla_ext.metrics import peak_rss_bytes
    from torch_xla_ext.workloads import make_batch, make_decoder_stack, training_step

    device = torch_xla.device()
    unroll, = args.unroll
    model = make_decoder_stack(args.layers, args.hidden, args.heads, args.mode,
                               intermediate=args.intermediate, device=device, block=args.block,
                               unroll=unroll)
    batch = make_batch(args.batch, args.seq, args.hidden, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch_xla.sync()
    xm.wait_device_ops()
    met.clear_all()

    def run_step():
        torch_xla.sync()
        xm.wait_device_ops()

    # The previous step's gradients are released before the timer starts:
    # freeing a buffer of 32 MiB or more is an munmap, which takes up to 0.1 s
    # on some VMs; that is allocator time, not graph building.
    times = harness.time_steps(
        args.steps, lambda: training_step(model, batch, optimizer), run_step,
        prepare=lambda step: optimizer.zero_grad(set_to_none=True))

    compiles, compile_ns, _ = met.metric_data("CompileTime") or (0, 0, None)
    peak_rss = peak_rss_bytes()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        forward_times = harness.time_steps(args.steps, lambda: model(batch[0]), run_step)
    steady = slice(WARMUP_STEPS, None)
    op_times = (harness.op_time_figures(lambda: training_step(model, batch, optimizer))
                if args.op_times else None)
    return {
        "op_times": op_times,
        "python_ms": 1e3 * statistics.median(times.build[steady]),
        "compile_s": compile_ns / 1e9,
        "compiles": compiles,
        "execute_ms": 1e3 * statistics.median(times.finish[steady]),
        "execute_cpu_ms": 1e3 * statistics.median(times.finish_cpu[steady]),
        "forward_ms": 1e3 * statistics.median(forward_times.finish[steady]),
        "forward_cpu_ms": 1e3 * statistics.median(forward_times.finish_cpu[steady]),
        "peak_rss_mib": peak_rss / 2**20,
        "peak_is_steady": times.peak_is_last_steps,
        "param_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
    }


def print_ratios(rounds: list[dict[tuple[str, int], dict]], layer_counts: list[int],
                 markdown: bool) -> None:
    """The goal lines, each ratio the median over `rounds` (figures by (mode, L))."""
    middle = 32 if 32 in layer_counts else max(layer_counts)
    smallest, largest = min(layer_counts), max(layer_counts)
    goals = []

    def ratio(label, numerator, denominator, figure, goal):
        goals.append(harness.goal_over_rounds(label, rounds, numerator, denominator, figure,
                                              goal))

    ratio(f"python time scan/loop at L={middle}", ("scan", middle), ("loop", middle),
          "python_ms", 0.2)
    ratio(f"python time scan/torch-xla-scan at L={middle}", ("scan", middle),
          ("torch-xla-scan", middle), "python_ms", 0.1)
    ratio(f"python time scan L={largest}/L={smallest}", ("scan", largest), ("scan", smallest),
          "python_ms", 1.3)
    ratio(f"compile time scan/loop at L={middle}", ("scan", middle), ("loop", middle),
          "compile_s", 0.3)
    ratio(f"compile time scan L={largest}/L={smallest}", ("scan", largest), ("scan", smallest),
          "compile_s", 1.3)
    # Issue 28's goals: at or below the loop in time and memory.
    for figure, what in (("execute_ms", "execution"), ("execute_cpu_ms", "execution CPU time"),
                         ("forward_ms", "forward-only execution"),
                         ("forward_cpu_ms", "forward-only CPU time")):
        ratio(f"{what} scan/loop at L={middle}", ("scan", middle), ("loop", middle), figure, 1.00)
    ratio(f"peak RSS scan/loop at L={middle}", ("scan", middle), ("loop", middle),
          "peak_rss_mib", 1.00)
    print(harness.goal_table(goals, markdown))


def print_unroll_ratios(rounds: list[dict[tuple[str, int], dict]], layer_counts: list[int],
                        unrolls: list[int], markdown: bool) -> None:
    """Per L and unroll k, the run "scan unroll=k" over the loop: execution
    (training and forward-only) and compile time, each the median over `rounds`;
    a markdown table with `markdown`."""
    from torch_xla_ext.metrics.table import render_rows

    def cell(numerator, denominator, figure):
        value, spread = harness.median_and_spread(
            [harness.ratio(figures, numerator, denominator, figure) for figures in rounds])
        if value is None:
            return "n/a"
        return f"{value:.3f}" + ("" if spread is None else f" ({spread[0]:.3f}-{spread[1]:.3f})")

    rows: list = [["L", "unroll", "exec scan/loop", "fwd exec scan/loop", "compile scan/loop"],
                  None]
    for layers in layer_counts:
        for unroll in unrolls:
            run, loop = (scan_run(unroll), layers), ("loop", layers)
            rows.append([str(layers), str(unroll), cell(run, loop, "execute_ms"),
                         cell(run, loop, "forward_ms"), cell(run, loop, "compile_s")])
    print(render_rows(rows, markdown))


def print_memory(by_key: dict[tuple[str, int], dict], markdown: bool) -> None:
    """Peak RSS growth over the for loop, as a share of the parameter bytes."""
    from torch_xla_ext.metrics.table import render_rows

    loop = next((r for (mode, _), r in by_key.items() if mode == "loop"), None)
    if loop is None:
        return
    print("\nPeak RSS of a steady step over the for loop's, in parameter bytes:")
    rows: list = [["mode", "L", "growth", "goal", "verdict"], None]
    for (mode, layers), r in by_key.items():
        if mode == "loop":
            continue
        growth = (r["peak_rss_mib"] - loop["peak_rss_mib"]) / r["param_mib"]
        goal = ["<= 0.10", harness.verdict(growth, 0.10)] if mode == "scan" else ["-", "-"]
        rows.append([mode, str(layers), f"{growth:+.2f}x", *goal])
    print(render_rows(rows, markdown))


def main(argv: list[str] | None = None) -> None:
    parser = harness.benchmark_parser(__file__, __doc__)
    harness.add_layer_and_mode_options(parser, MODES)
    parser.add_argument("--memory", action="store_true",
                        help="16 layers, hidden 1024, MLP 4096 (1 GiB of weights), seq 16, "
                             "batch 1: compares peak RSS")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=None,
                        help="MLP width (default 4 x hidden)")
    parser.add_argument("--block", default=BLOCKS[0],
                        help=f"comma-separated layer kinds, each measured apart: "
                             f"{', '.join(BLOCKS)} (default {BLOCKS[0]})")
    parser.add_argument("--unroll", type=harness.positive_ints, default=[1],
                        help="comma-separated layers per iteration of mode scan's loops "
                             "(LayerStack's unroll), each measured as a run of its own; ratios "
                             "over the loop are printed side by side (default 1; one int in "
                             "--worker)")
    harness.add_op_times_option(parser, "training steps")
    harness.add_rounds_option(parser)
    harness.add_worker_options(parser, DEFAULT_TIMEOUT)
    args = parser.parse_args(argv)

    if args.worker:
        args.layers = int(args.layers)
        harness.report_result(run_worker(args))
        return

    blocks = args.block.split(",")
    unknown = sorted(set(blocks) - set(BLOCKS))
    if unknown:
        parser.error(f"unknown blocks {unknown}; choose from {', '.join(BLOCKS)}")

    if args.memory:
        args.hidden, args.heads, args.intermediate, args.seq, args.batch = 1024, 8, 4096, 16, 1
        args.layers = args.layers or "16"
    layer_counts, modes = harness.chosen_runs(parser, args, MODES, WARMUP_STEPS)
    unrolled = args.unroll != [1]
    if unrolled and "scan" not in modes:
        parser.error(f"--unroll {','.join(map(str, args.unroll))} is for mode scan, which "
                     f"--modes leaves out; add scan to --modes")
    runs = worker_modes(modes, args.unroll)

    print(f"PJRT {harness.device_name()}, hidden {args.hidden}, {args.heads} heads, seq "
          f"{args.seq}, batch {args.batch}, {args.steps} steps (first {WARMUP_STEPS} not "
          "steady)", flush=True)
    all_outcomes = {}
    for block in blocks:
        every_round = harness.measure_rounds(
            os.path.abspath(__file__), list(runs), layer_counts,
            [*harness.passed_on(args, WORKLOAD_OPTIONS), "--block", block], args.timeout,
            args.rounds, f"block {block}",
            lambda outcomes: harness.print_layer_table(outcomes, args.markdown), runs.__getitem__)
        for outcomes in every_round:
            all_outcomes.update({(f"{block} {mode}" if len(blocks) > 1 else mode, layers): outcome
                                 for (mode, layers), outcome in outcomes.items()})
        rounds = [harness.figures_by_run(outcomes) for outcomes in every_round]
        if args.memory:
            print_memory(rounds[-1], args.markdown)
        else:
            print(f"\nRatios, block {block}" + (f", median of {args.rounds} rounds (spread)"
                                                if args.rounds > 1 else "") + ":")
            print_ratios(rounds, layer_counts, args.markdown)
            if args.op_times:
                print(f"\nWhere a training step's time went, block {block}, op by op (count "
                      f"and wall ms of each kind of op, per step; last round):")
                harness.print_op_times(rounds[-1], args.markdown)
            if unrolled:
                print(f"\nUnroll (layers per loop iteration), block {block}, over the loop"
                      + (f", median of {args.rounds} rounds (spread)" if args.rounds > 1
                         else "") + ":")
                print_unroll_ratios(rounds, layer_counts, args.unroll, args.markdown)
    harness.exit_if_runs_failed(parser.prog, all_outcomes)


if __name__ == "__main__":
    main()
