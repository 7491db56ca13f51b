#!/usr/bin/env python
"""Benchmark a training step over L decoder blocks: for loop, LayerStack, torch_xla scan_layers.

Each (mode, L) runs in a fresh process (scripts/harness.py, within --timeout
seconds) on the device PJRT_DEVICE names, CPU if it is not set: build the model
(`torch_xla_ext.workloads`), run `--steps` training steps (forward, MSE loss,
backward, SGD), and report

* python ms:  Python time of a steady step, from its start until just before
              `torch_xla.sync()` (building the lazy graph; the previous step's
              gradients are released before the timer starts),
* compile s:  XLA compile time over all steps (metric `CompileTime`, total),
* compiles:   number of XLA compilations over all steps,
* exec ms:    wall time of `torch_xla.sync()` + `wait_device_ops()` of a steady step,
* peak RSS:   peak resident memory during the last steady step (VmHWM after
              resetting it through /proc/self/clear_refs).

Steady steps are the ones after the first two; figures are their medians.
The summary prints the ratios the layer-stack issue asks for.

  python scripts/bench_layers.py                 # L = 8, 32, 64
  python scripts/bench_layers.py --quick         # L = 2, 4: a quick check
  python scripts/bench_layers.py --memory        # 16 layers holding 1 GiB of weights
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import harness  # first: it sets the default device before torch_xla is imported

MODES = ("loop", "scan", "torch-xla-scan")
WARMUP_STEPS = 2
# Seconds one (mode, L) may take: L=64 with torch_xla's scan_layers takes minutes.
DEFAULT_TIMEOUT = 1800


def run_worker(args) -> dict:
    """One (mode, L) measurement in this process; returns the figures."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from torch_xla_ext.metrics import peak_rss_bytes, reset_peak_rss
    from torch_xla_ext.workloads import make_batch, make_decoder_stack, training_step

    device = torch_xla.device()
    model = make_decoder_stack(args.layers, args.hidden, args.heads, args.mode,
                               intermediate=args.intermediate, device=device)
    batch = make_batch(args.batch, args.seq, args.hidden, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch_xla.sync()
    xm.wait_device_ops()
    met.clear_all()

    python_seconds, execute_seconds = [], []
    peak_reset = False
    for step in range(args.steps):
        if step == args.steps - 1:
            peak_reset = reset_peak_rss()
        # The previous step's gradients are released before the timer starts:
        # freeing a buffer of 32 MiB or more is an munmap, which takes up to 0.1 s
        # on some VMs; that is allocator time, not graph building.
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        training_step(model, batch, optimizer)
        built = time.perf_counter()
        torch_xla.sync()
        xm.wait_device_ops()
        python_seconds.append(built - start)
        execute_seconds.append(time.perf_counter() - built)

    compiles, compile_ns, _ = met.metric_data("CompileTime") or (0, 0, None)
    steady = slice(WARMUP_STEPS, None)
    return {
        "python_ms": 1e3 * statistics.median(python_seconds[steady]),
        "compile_s": compile_ns / 1e9,
        "compiles": compiles,
        "execute_ms": 1e3 * statistics.median(execute_seconds[steady]),
        "peak_rss_mib": peak_rss_bytes() / 2**20,
        "peak_is_steady": peak_reset,
        "param_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
    }


def measure(mode: str, layers: int, args) -> harness.Outcome:
    """Runs one (mode, L) in a fresh process within the time limit."""
    arguments = ["--worker", "--mode", mode, "--layers", str(layers), "--steps", str(args.steps),
                 "--hidden", str(args.hidden), "--heads", str(args.heads), "--seq", str(args.seq),
                 "--batch", str(args.batch)]
    if args.intermediate:
        arguments += ["--intermediate", str(args.intermediate)]
    outcome = harness.run_worker(os.path.abspath(__file__), arguments, args.timeout)
    if not outcome.ok:
        print(outcome.failure_report(f"  {mode} L={layers}"), flush=True)
    return outcome


def print_table(outcomes: dict[tuple[str, int], harness.Outcome]) -> None:
    """A line per (mode, L): its figures, or the status of a run that gave none."""
    header = (f"{'mode':<16}{'L':>4}{'python ms':>11}{'compile s':>11}{'compiles':>10}"
              f"{'exec ms':>10}{'peak RSS MiB':>14}{'params MiB':>12}")
    print(header)
    print("-" * len(header))
    for (mode, layers), outcome in outcomes.items():
        r = outcome.figures
        if r is None:
            print(f"{mode:<16}{layers:>4}  {outcome.status}")
            continue
        steady = "" if r["peak_is_steady"] else " (lifetime peak)"
        print(f"{mode:<16}{layers:>4}{r['python_ms']:>11.2f}{r['compile_s']:>11.2f}"
              f"{r['compiles']:>10}{r['execute_ms']:>10.1f}{r['peak_rss_mib']:>14.0f}"
              f"{r['param_mib']:>12.1f}{steady}")


def print_ratios(by_key: dict[tuple[str, int], dict], layer_counts: list[int]) -> None:
    middle = 32 if 32 in layer_counts else max(layer_counts)
    smallest, largest = min(layer_counts), max(layer_counts)

    def ratio(label, numerator, denominator, figure, goal):
        a, b = by_key.get(numerator), by_key.get(denominator)
        if a is None or b is None or not b[figure]:
            print(f"  {label:<46} n/a (missing run)")
            return
        value = a[figure] / b[figure]
        verdict = "ok" if value <= goal else "MISSED"
        print(f"  {label:<46} {value:6.3f}   goal <= {goal:<5} {verdict}")

    print("\nRatios:")
    ratio(f"python time scan/loop at L={middle}", ("scan", middle), ("loop", middle),
          "python_ms", 0.2)
    ratio(f"python time scan/torch-xla-scan at L={middle}", ("scan", middle),
          ("torch-xla-scan", middle), "python_ms", 0.1)
    ratio(f"python time scan L={largest}/L={smallest}", ("scan", largest), ("scan", smallest),
          "python_ms", 1.3)
    ratio(f"compile time scan/loop at L={middle}", ("scan", middle), ("loop", middle),
          "compile_s", 0.5)
    ratio(f"compile time scan L={largest}/L={smallest}", ("scan", largest), ("scan", smallest),
          "compile_s", 1.3)
    ratio(f"execution scan/loop at L={middle}", ("scan", middle), ("loop", middle),
          "execute_ms", 1.10)


def print_memory(by_key: dict[tuple[str, int], dict]) -> None:
    """Peak RSS growth over the for loop, as a share of the parameter bytes."""
    loop = next((r for (mode, _), r in by_key.items() if mode == "loop"), None)
    if loop is None:
        return
    print("\nPeak RSS of a steady step over the for loop's, in parameter bytes:")
    for (mode, layers), r in by_key.items():
        if mode == "loop":
            continue
        growth = (r["peak_rss_mib"] - loop["peak_rss_mib"]) / r["param_mib"]
        goal = "  goal <= 0.10 " + ("ok" if growth <= 0.10 else "MISSED") if mode == "scan" else ""
        print(f"  {mode:<16} L={layers:<4} {growth:+.2f}x{goal}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default=None,
                        help="comma-separated layer counts (default 8,32,64; one int in --worker)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    parser.add_argument("--quick", action="store_true", help="layer counts 2,4 only")
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
    parser.add_argument("--timeout", type=harness.time_limit, default=DEFAULT_TIMEOUT,
                        metavar="SECONDS",
                        help=f"time limit of each run's process (default {DEFAULT_TIMEOUT}); "
                             "a run that exceeds it is reported as timed out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        args.layers = int(args.layers)
        harness.report_result(run_worker(args))
        return

    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")
    if args.memory:
        args.hidden, args.heads, args.intermediate, args.seq, args.batch = 1024, 8, 4096, 16, 1
        args.layers = args.layers or "16"
    layer_counts = [int(n) for n in (args.layers or ("2,4" if args.quick else "8,32,64")).split(",")]
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")

    print(f"PJRT {harness.device_name()}, hidden {args.hidden}, {args.heads} heads, seq "
          f"{args.seq}, batch {args.batch}, {args.steps} steps (first {WARMUP_STEPS} not "
          "steady)", flush=True)
    outcomes = {}
    for layers in layer_counts:
        for mode in modes:
            outcome = outcomes[mode, layers] = measure(mode, layers, args)
            print(f"  ran {mode} L={layers} in {outcome.seconds:.0f} s", flush=True)
    print()
    print_table(outcomes)
    figures = {key: outcome.figures for key, outcome in outcomes.items() if outcome.ok}
    if args.memory:
        print_memory(figures)
    else:
        print_ratios(figures, layer_counts)
    failures = harness.failure_summary(
        {f"{mode} L={layers}": outcome for (mode, layers), outcome in outcomes.items()})
    if failures:
        sys.exit(f"bench_layers.py: error: {failures}")


if __name__ == "__main__":
    main()
