#!/usr/bin/env python
"""Nested scans: an inner scan as a While loop of its own, against the same
inner steps unrolled into the outer step (what a nested scan was before, and
what an outer step holding a group of layers is).

The workload: `--groups` outer steps, each an inner scan over `--inner` layers
(a `--width`-wide residual MLP block, its weights `[groups, inner, width,
width]`), one training step (forward, backward, sync). Mode `nested` calls
`scan` inside the outer `fn`; mode `unrolled` runs the inner layers as a
Python for loop there. Each (mode, inner length, round) is a fresh process;
both modes must give the same loss. Prints per inner length the first step's
wall time (trace, compile and run) and XLA's compile time, with the ratios
nested / unrolled (medians over `--rounds`, with their spread), and how the
nested compile grows with the inner length (longest over shortest).

  python scripts/bench_nested.py                          # inner 2,8,32, one round
  python scripts/bench_nested.py --inner 2,16 --rounds 3 --markdown
"""
from __future__ import annotations

import argparse
import sys
import time

import harness  # first: it sets the default device before torch_xla is imported
from harness import median_cell
from torch_xla_ext.metrics.table import render_rows

MODES = ("nested", "unrolled")


def worker(mode: str, groups: int, inner: int, width: int) -> None:
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    import torch_xla_ext as tx

    device = torch_xla.device()
    torch.manual_seed(0)
    weights = (torch.randn(groups, inner, width, width) / width ** 0.5).to(device)
    weights.requires_grad_()
    hidden = torch.randn(8, width).to(device)

    def layer(h, w):
        return h + torch.tanh(torch.nn.functional.layer_norm(h @ w, (width,))), None

    def group(h, group_weights):
        if mode == "nested":
            h, _ = tx.scan(layer, h, group_weights)
        else:
            for position in range(inner):
                h, _ = layer(h, group_weights[position])
        return h, None

    start = time.perf_counter()
    last, _ = tx.scan(group, hidden, weights)
    loss = last.square().mean()
    loss.backward()
    torch_xla.sync(wait=True)
    first_step = time.perf_counter() - start
    compile_ns = met.metric_data("CompileTime")
    harness.report_result({"first_step_s": first_step,
                           "compile_s": compile_ns[1] / 1e9 if compile_ns else 0.0,
                           "loss": loss.item()})


def main(argv=None) -> None:
    parser = harness.benchmark_parser(__file__, __doc__)
    parser.add_argument("--inner", type=harness.positive_ints, default=[2, 8, 32],
                        help="comma-separated inner lengths (default 2,8,32)")
    parser.add_argument("--groups", type=harness.positive_int, default=4,
                        help="outer steps (default 4)")
    parser.add_argument("--width", type=harness.positive_int, default=128,
                        help="width of each layer (default 128)")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    harness.add_rounds_option(parser)
    harness.add_worker_options(parser, default_timeout=600)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.mode, args.groups, args.inner[0], args.width)
        return
    rounds = []
    for round_number in range(args.rounds):
        figures = {}
        for inner in args.inner:
            for mode in MODES:
                label = f"{mode} inner={inner} (round {round_number + 1})"
                outcome = harness.measure(
                    __file__, ["--worker", "--mode", mode, "--inner", str(inner),
                               "--groups", str(args.groups), "--width", str(args.width)],
                    args.timeout, label)
                figures[mode, inner] = outcome.figures
        rounds.append(figures)
    missing = [f"{mode} inner={inner}" for figures in rounds
               for (mode, inner), value in figures.items() if value is None]
    harness.exit_on_problems(parser.prog, [f"runs failed: {', '.join(missing)}"
                                           if missing else None])
    losses = {(mode, inner): figures[mode, inner]["loss"]
              for figures in rounds for mode, inner in figures}
    unequal = [inner for inner in args.inner
               if abs(losses["nested", inner] - losses["unrolled", inner])
               > 1e-5 * abs(losses["unrolled", inner])]
    print(f"\n{args.groups} groups of an inner scan, width {args.width}, one training step; "
          f"{args.rounds} round(s), medians (spread); losses equal: "
          f"{'yes' if not unequal else 'NO at inner ' + ', '.join(map(str, unequal))}\n")
    rows = []
    for inner in args.inner:
        row = [str(inner)]
        for figure in ("first_step_s", "compile_s"):
            for mode in MODES:
                value, _ = harness.median_and_spread([f[mode, inner][figure] for f in rounds])
                row.append(f"{value:.2f}")
            row.append(median_cell([f["nested", inner][figure] / f["unrolled", inner][figure]
                                    for f in rounds]))
        rows.append(row)
    header = ["inner", "first step nested s", "unrolled s", "x", "compile nested s",
              "unrolled s", "x"]
    print(render_rows([header, None, *rows], args.markdown))
    shortest, longest = min(args.inner), max(args.inner)
    if longest > shortest:
        for mode in MODES:
            growth = median_cell([f[mode, longest]["compile_s"] / f[mode, shortest]["compile_s"]
                                  for f in rounds])
            print(f"\n{mode}: compile at inner {longest} / at inner {shortest}: {growth}")
    if unequal:
        sys.exit(f"{parser.prog}: the modes' losses differ at inner {unequal}")


if __name__ == "__main__":
    main()
