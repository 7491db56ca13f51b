#!/usr/bin/env python
"""Memory and time of a LayerStack training step under each activation policy.

A policy (`torch_xla_ext.policies`, given to the stack as `partition_fn`)
decides what the forward loop keeps for the backward loop and what the
backward loop recomputes. Each policy runs in a fresh process
(scripts/harness.py, within --timeout seconds) on the device PJRT_DEVICE names,
CPU if it is not set: build `torch_xla_ext.workloads`' decoder stack as a
LayerStack (the same weights for every policy), then run `--steps` training
steps (forward, MSE loss, backward, SGD) on the same batch, and report

* compile s:  XLA compile time over all steps (metric `CompileTime`, total),
* compiles:   number of XLA compilations over all steps,
* step time:  wall time of a steady step, building its graph to the end of
              its execution (median of the steps after the first),
* peak RSS:   peak resident memory during the last step (VmHWM after
              resetting it through /proc/self/clear_refs),
* parameters: bytes of the stack's parameters (their gradients take as many).

Each worker also saves the gradients of its first step; the parent prints each
policy's largest difference from save_everything's, which every policy must
match within 1e-4, and the ratio of peak RSS the issue asks for.

Policies are written `save_everything`, `save_nothing`, `save_dots`, or
`save_only:NAMES` and `offload:NAMES` with NAMES joined by `+`, the names that
`DecoderBlock` gives with `checkpoint_name`: `attn_out` (the attention's
output) and `mlp_hidden` (the MLP's hidden activation, input of down_proj).

  python scripts/bench_policies.py           # hidden 1024, 8 heads, seq 512, batch 4, L=16
  python scripts/bench_policies.py --quick   # tiny shapes: a quick check
  python scripts/bench_policies.py --policies save_everything,save_only:attn_out
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import harness  # first: it sets the default device before torch_xla is imported
from torch_xla_ext.metrics import BYTES, COUNT, SECONDS, Row

POLICIES = ("save_everything", "save_nothing", "save_dots", "save_only:attn_out+mlp_hidden",
            "offload:attn_out+mlp_hidden")
BASELINE = "save_everything"
GRADIENT_ATOL = 1e-4
RSS_RATIO_GOAL = 0.70
# The issue's sizes, and tiny ones for a quick check; options given explicitly win.
ISSUE_SIZES = {"layers": 16, "hidden": 1024, "heads": 8, "seq": 512, "batch": 4, "steps": 3}
QUICK_SIZES = {"layers": 2, "hidden": 32, "heads": 4, "seq": 8, "batch": 2, "steps": 2}
# The first step compiles; the ones after it are steady.
FIRST_STEADY_STEP = 1
# Seconds one policy's process may take: a step at the issue's sizes takes about a minute.
DEFAULT_TIMEOUT = 1800


def parse_policy(text: str):
    """The policy `text` writes (see the module docstring); ValueError if there is none."""
    from torch_xla_ext import policies

    kind, colon, names = text.partition(":")
    if not colon:
        return policies.resolve(text, who="--policies")
    by_kind = {"save_only": policies.save_only, "offload": policies.offload}
    if kind not in by_kind:
        raise ValueError(f"--policies: {text!r}: only save_only and offload take names "
                         f"(save_only:attn_out+mlp_hidden); {kind!r} is not one of them")
    return by_kind[kind](*(name for name in names.split("+") if name))


def run_worker(args) -> dict:
    """One policy's measurement in this process; returns the figures."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from torch_xla_ext.metrics import peak_rss_bytes
    from torch_xla_ext.workloads import make_batch, make_decoder_stack, training_step

    device = torch_xla.device()
    # Seeded by make_decoder_stack: every policy starts from the same weights.
    model = make_decoder_stack(args.layers, args.hidden, args.heads, "scan", device=device)
    model.layers.partition_fn = parse_policy(args.policy)
    batch = make_batch(args.batch, args.seq, args.hidden, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch_xla.sync()
    xm.wait_device_ops()
    met.clear_all()

    def release_gradients(step):
        if step == 1:  # the first step's, kept for the parent to compare
            torch.save({name: p.grad.cpu() for name, p in model.named_parameters()
                        if p.grad is not None}, args.grads_file)
        optimizer.zero_grad(set_to_none=True)

    def run_step():
        torch_xla.sync()
        xm.wait_device_ops()

    # Gradients are released before the peak is reset (time_steps), so that
    # the last step's peak is its own.
    times = harness.time_steps(args.steps, lambda: training_step(model, batch, optimizer),
                               run_step, prepare=release_gradients)

    compiles, compile_ns, _ = met.metric_data("CompileTime") or (0, 0, None)
    return {
        "compile_s": compile_ns / 1e9,
        "compiles": compiles,
        "step_s": statistics.median(times.total[FIRST_STEADY_STEP:]),
        "peak_rss": peak_rss_bytes(),
        "peak_is_steady": times.peak_is_last_steps,
        "params": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def measure(policy: str, grads_file: str, args) -> harness.Outcome:
    """Runs one policy in a fresh process within the time limit."""
    arguments = ["--worker", "--policy", policy, "--grads-file", grads_file,
                 *harness.passed_on(args, ISSUE_SIZES)]
    return harness.measure(os.path.abspath(__file__), arguments, args.timeout, policy)


def gradient_difference(grads_file: str, baseline_file: str) -> float | str:
    """The largest absolute difference between two workers' gradients, or why
    they cannot be compared."""
    import torch

    grads = torch.load(grads_file)
    baseline = torch.load(baseline_file)
    if grads.keys() != baseline.keys():
        return (f"gradients of other parameters: {sorted(grads.keys() ^ baseline.keys())} "
                f"in one only")
    return max((grads[name] - baseline[name]).abs().max().item() for name in grads)


def print_gradients(differences: dict[str, float | str | None], markdown: bool) -> list[str]:
    """A line per policy (a markdown table with `markdown`); returns the
    policies whose gradients are off."""
    from torch_xla_ext.metrics.table import render_rows

    print(f"\nFirst step's gradients against {BASELINE}'s (atol {GRADIENT_ATOL:g}):")
    rows: list = [["policy", "max abs diff", "verdict"], None]
    off = []
    for policy, difference in differences.items():
        if difference is None:
            rows.append([policy, "n/a (missing run)"])
        elif isinstance(difference, str):
            off.append(policy)
            rows.append([policy, difference])
        else:
            agree = difference <= GRADIENT_ATOL
            off += [] if agree else [policy]
            rows.append([policy, f"{difference:.3g}", "within atol" if agree else "DIFFER"])
    if differences:
        print(render_rows(rows, markdown))
    return off


def print_rss_ratio(figures: dict[str, dict], markdown: bool) -> None:
    """The issue's ratio of peak RSS against its goal."""
    ratio = harness.ratio(figures, "save_nothing", BASELINE, "peak_rss")
    print()
    print(harness.goal_table([harness.Goal("peak RSS save_nothing / save_everything", ratio,
                                           RSS_RATIO_GOAL)], markdown))


def main(argv: list[str] | None = None) -> None:
    parser = harness.benchmark_parser(__file__, __doc__)
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated policies (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes and 2 steps: "
                             + ", ".join(f"{k} {v}" for k, v in QUICK_SIZES.items()))
    for option, value in ISSUE_SIZES.items():
        parser.add_argument(f"--{option}", type=int, default=None,
                            help=f"(default {value}, the issue's)")
    harness.add_worker_options(parser, DEFAULT_TIMEOUT, run="policy")
    parser.add_argument("--policy", help=argparse.SUPPRESS)
    parser.add_argument("--grads-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else ISSUE_SIZES
    for option, value in sizes.items():
        if getattr(args, option) is None:
            setattr(args, option, value)

    if args.worker:
        harness.report_result(run_worker(args))
        return

    if args.steps <= FIRST_STEADY_STEP:
        parser.error(f"--steps must be at least {FIRST_STEADY_STEP + 1}: the first step "
                     "compiles, the steps after it are measured")
    chosen = list(dict.fromkeys(filter(None, args.policies.split(","))))
    for policy in chosen:
        try:
            parse_policy(policy)
        except (TypeError, ValueError) as error:
            parser.error(str(error))

    print(f"PJRT {harness.device_name()}, LayerStack of {args.layers} decoder blocks, hidden "
          f"{args.hidden}, {args.heads} heads, seq {args.seq}, batch {args.batch}, SGD, "
          f"{args.steps} steps (the first not steady)", flush=True)
    outcomes, differences = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_policies_") as grads_dir:
        # The baseline runs first, so that each policy's gradients are compared
        # (and their file deleted) as soon as it ends.
        order = sorted(chosen, key=lambda policy: policy != BASELINE)
        files = {policy: os.path.join(grads_dir, f"{index}.pt")
                 for index, policy in enumerate(order)}
        for policy in order:
            outcome = outcomes[policy] = measure(policy, files[policy], args)
            if policy == BASELINE:
                continue
            baseline_ran = BASELINE in outcomes and outcomes[BASELINE].ok
            differences[policy] = (gradient_difference(files[policy], files[BASELINE])
                                   if outcome.ok and baseline_ran else None)
            if os.path.exists(files[policy]):
                os.remove(files[policy])

    rows = (Row("compile_s", "compile s", SECONDS), Row("compiles", "compiles", COUNT),
            Row("step_s", "steady step time", SECONDS), Row("peak_rss", "peak RSS", BYTES),
            Row("params", "parameters", BYTES))
    print()
    print(harness.outcome_table({policy: outcomes[policy] for policy in chosen}, rows,
                                baseline=BASELINE if BASELINE in chosen else None,
                                markdown=args.markdown))
    lifetime = [policy for policy in chosen
                if outcomes[policy].ok and not outcomes[policy].figures["peak_is_steady"]]
    if lifetime:
        print(f"\n(peak RSS of the process's lifetime, not of the last step: "
              f"{', '.join(lifetime)})")
    figures = {policy: outcome.figures for policy, outcome in outcomes.items() if outcome.ok}
    off = print_gradients(differences, args.markdown)
    print_rss_ratio(figures, args.markdown)

    harness.exit_on_problems(parser.prog, [
        harness.failure_summary(outcomes),
        f"gradients of {', '.join(off)} differ from {BASELINE}'s by more than "
        f"{GRADIENT_ATOL:g}" if off else None])


if __name__ == "__main__":
    main()
