#!/usr/bin/env python
"""Benchmark torch_xla's export flow on a LlamaForCausalLM, converted or not:
`torch.export.export` of the model on the CPU, then
`torch_xla.stablehlo.exported_program_to_stablehlo` of the exported program
(with `register_torch_scan()` in effect), at each depth, side by side.

* loop:          the model as transformers builds it: the exported graph holds
                 a copy of the decoder layer's ops per layer;
* stack_layers:  the same model after `torch_xla_ext.stack_layers(model)`: the
                 exported graph holds one node of torch's scan operator,
                 lowered to one `stablehlo.while`.

Each (mode, L) runs in a fresh process (scripts/harness.py, within --timeout
seconds): build the model from a config with random weights (hidden 256, 4
heads, 2 key/value heads, intermediate 512, vocab 1024, use_cache=False, eval
mode), export its forward on a batch of --batch sequences of --seq token ids,
lower the exported program, then run the lowered program once on XLA and
compare its logits with the model's own on the CPU (not timed). Columns:

* export s:   wall time of `torch.export.export` (the converted model's first
              call also plans its layer calls: the dry run on fakes),
* lower s:    wall time of `exported_program_to_stablehlo`,
* nodes:      nodes of the exported graph but its inputs (one per parameter
              and buffer, as many converted as not), scans: its scan
              operator nodes,
* whiles:     `stablehlo.while` ops of the StableHLO, StableHLO KiB: its text,
* max diff:   max |logits of the lowered program on XLA - the model's on the CPU|.

The summary prints the ratios at L=32 (converted / unconverted) and the
converted model's L=64 / L=8 (flat in depth); with --rounds N, every (mode, L)
runs N times and each ratio is the median of the rounds', with their spread.

  python scripts/bench_export.py                 # L = 8, 32, 64
  python scripts/bench_export.py --rounds 3
  python scripts/bench_export.py --quick         # L = 2, 4: a quick check
"""
from __future__ import annotations

import os
import time

import harness  # first: it sets the default device before torch_xla is imported

MODES = ("loop", "stack_layers")
DEFAULT_TIMEOUT = 1800
WORKLOAD_OPTIONS = (*harness.LLAMA_SIZE_OPTIONS, "seq", "batch")


def run_worker(args) -> dict:
    """One (mode, L) measurement in this process; returns the figures."""
    import torch
    import torch_xla
    import transformers
    from torch_xla.stablehlo import exported_program_to_stablehlo

    import torch_xla_ext as tx

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(harness.llama_config(args, use_cache=False)).eval()
    if args.mode == "stack_layers":
        tx.stack_layers(model)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1))

    started = time.perf_counter()
    exported = torch.export.export(model, (ids,))
    export_s = time.perf_counter() - started
    with tx.register_torch_scan():
        started = time.perf_counter()
        lowered = exported_program_to_stablehlo(exported)
        lower_s = time.perf_counter() - started
        text = lowered.get_stablehlo_text()
        logits = lowered(ids).logits.cpu()
    with torch.no_grad():
        expected = model(ids).logits  # on the CPU, the converted layers one by one
    targets = [node.target for node in exported.graph.nodes if node.op != "placeholder"]
    return {
        "export_s": export_s,
        "lower_s": lower_s,
        "nodes": len(targets),
        "scan_nodes": targets.count(torch.ops.higher_order.scan),
        "whiles": text.count("stablehlo.while"),
        "stablehlo_kib": len(text) / 1024,
        "max_diff": (logits - expected).abs().max().item(),
        "device": str(torch_xla.device()),
    }


def print_table(outcomes, markdown: bool) -> None:
    harness.print_runs_table(outcomes, [
        ("export s", lambda r: f"{r['export_s']:.2f}"),
        ("lower s", lambda r: f"{r['lower_s']:.2f}"),
        ("nodes", lambda r: str(r["nodes"])),
        ("scans", lambda r: str(r["scan_nodes"])),
        ("whiles", lambda r: str(r["whiles"])),
        ("StableHLO KiB", lambda r: f"{r['stablehlo_kib']:.0f}"),
        ("max diff", lambda r: f"{r['max_diff']:.1e}"),
    ], markdown)


def goals(rounds, layer_counts) -> list:
    """The ratios against their goals, each the median over `rounds`."""
    middle = 32 if 32 in layer_counts else max(layer_counts)
    smallest, largest = min(layer_counts), max(layer_counts)
    checked = []
    for figure, what in (("export_s", "export time"), ("lower_s", "lowering time")):
        checked.append(harness.goal_over_rounds(
            f"{what} stack_layers/loop at L={middle}", rounds, ("stack_layers", middle),
            ("loop", middle), figure, 0.5))
    for figure, what in (("export_s", "export time"), ("lower_s", "lowering time")):
        checked.append(harness.goal_over_rounds(
            f"{what} stack_layers L={largest}/L={smallest}", rounds, ("stack_layers", largest),
            ("stack_layers", smallest), figure, 1.3))
    return checked


def main(argv: list[str] | None = None) -> None:
    parser = harness.benchmark_parser(__file__, __doc__)
    harness.add_layer_and_mode_options(parser, MODES)
    harness.add_llama_size_options(parser)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    harness.add_rounds_option(parser)
    harness.add_worker_options(parser, DEFAULT_TIMEOUT)
    args = parser.parse_args(argv)

    if args.worker:
        args.layers = int(args.layers)
        harness.report_result(run_worker(args))
        return

    layer_counts, modes = harness.chosen_runs(parser, args, MODES, None)
    print(f"PJRT {harness.device_name()}, {harness.llama_description(args)}, seq {args.seq}, "
          f"batch {args.batch}: torch.export on the CPU, then exported_program_to_stablehlo "
          f"(register_torch_scan)", flush=True)
    every_round = harness.measure_rounds(
        os.path.abspath(__file__), modes, layer_counts,
        harness.passed_on(args, WORKLOAD_OPTIONS), args.timeout, args.rounds, "export",
        lambda outcomes: print_table(outcomes, args.markdown))
    rounds = [harness.figures_by_run(outcomes) for outcomes in every_round]
    print("\nRatios" + (f", median of {len(rounds)} rounds (spread):" if len(rounds) > 1
                         else ":"))
    print(harness.goal_table(goals(rounds, layer_counts), args.markdown))
    for outcomes in every_round:
        harness.exit_if_runs_failed(parser.prog, outcomes)


if __name__ == "__main__":
    main()
