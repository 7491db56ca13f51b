#!/usr/bin/env python
"""Where the first training step of a converted model spends its time, stage
by stage, beside the unconverted model's, at flagship layouts' real depth.

Each model type (default: FLAGSHIPS) is built at the depth and layer pattern
of its transformers default config, every width shrunk as the causal-LM sweep
shrinks it (scripts/sweep_configs.py: hidden 64, 4 experts, vocab 256), with
random weights. Two fresh processes per type and round: the model unconverted,
and converted by `stack_layers`; each runs two SGD steps (forward with labels,
backward, `optimizer.step()`, `torch_xla.sync()`, waiting for the device).

The first step's wall time is split into:

* the project's own stages (converted only), the exclusive wall time of the
  functions that do them, which the worker wraps: `record calls`
  (`layer_stack.dry_run.record_calls`: the owner's forward run once with the
  layers recorded on stand-ins), `rehearse` (`layer_stack.kinds.program_of`:
  make_fx of a layer's step on fakes, to tell which layers compute alike),
  `plan` (`layer_stack.planner.plan_calls`, less the rehearsals it asks
  for), `trace` (`scan.tracing.trace`: the scan's step on placeholders),
  `differentiate` (`scan.autograd.TrainingPlan`: AOTAutograd's forward and
  backward graphs, less their lowering) and `lower` (`scan.loop.lower_body`:
  a step's graph as an HLO computation);
* `torch_xla tracing`: the rest of the host's work before the compile (the
  lazy graph of the model's own ops and of the scans' calls, the sync);
* `XLA compile`: torch_xla's CompileTime over the step, and `run`: its
  ExecuteTime.

`ours / unconverted tracing` is the project's own stages against the
unconverted step's host work outside compile and run (the goal: at most 1).
With --xla-passes, each worker also logs XLA's HLO pass timings
(it sets TF_CPP_VMODULE=hlo_pass_pipeline=1, which costs the compile a little; the
figures of such a run are not the headline ones) and the table lists the
passes that took longest in the converted and the unconverted compile, and the
compile's time outside the HLO passes (LLVM's code generation on XLA:CPU).

  python scripts/bench_first_step.py                        # FLAGSHIPS, one round
  python scripts/bench_first_step.py --types llama,jamba --rounds 3
  python scripts/bench_first_step.py --types gemma3 --layers 6 --xla-passes
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

import harness
from harness import median_cell

FLAGSHIPS = ("llama", "gemma3_text", "gemma4_text", "qwen3_next", "deepseek_v3", "gpt_oss",
             "smollm3", "jamba", "mixtral")
MODES = ("unconverted", "converted")
STEPS = 2
BATCH = 2
LR = 0.1
# The project's stages: (label, module, attribute path of the function).
STAGES = (
    ("record calls", "torch_xla_ext.layer_stack.dry_run", "record_calls"),
    ("rehearse", "torch_xla_ext.layer_stack.kinds", "program_of"),
    ("plan", "torch_xla_ext.layer_stack.planner", "plan_calls"),
    ("trace", "torch_xla_ext.scan.tracing", "trace"),
    ("differentiate", "torch_xla_ext.scan.autograd", "TrainingPlan.__init__"),
    ("lower", "torch_xla_ext.scan.loop", "lower_body"),
)
PASS_LINE = re.compile(r"HLO pass: (\S+) time: ([\d.]+) (us|ms|s)\b")
SECONDS_PER_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
PASSES_SHOWN = 6


# ---------------------------------------------------------------- the worker


class StageClock:
    """Exclusive wall time per stage: a stage called inside another counts
    for itself only."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._open: list[list] = []  # [label, started, inner seconds]

    def wrapped(self, label: str, function):
        def timed(*args, **kwargs):
            self._open.append([label, time.perf_counter(), 0.0])
            try:
                return function(*args, **kwargs)
            finally:
                _, started, inner = self._open.pop()
                spent = time.perf_counter() - started
                self.seconds[label] = self.seconds.get(label, 0.0) + spent - inner
                self.calls[label] = self.calls.get(label, 0) + 1
                if self._open:
                    self._open[-1][2] += spent
        timed.__wrapped__ = function
        return timed


def instrument(clock: StageClock) -> None:
    """Wraps each stage's function where it is defined and wherever a module
    of the package imported it by name."""
    import importlib

    for label, module_name, path in STAGES:
        owner = importlib.import_module(module_name)
        *classes, name = path.split(".")
        for each in classes:
            owner = getattr(owner, each)
        original = getattr(owner, name)
        setattr(owner, name, clock.wrapped(label, original))
        if classes:
            continue
        for module in list(sys.modules.values()):
            if (getattr(module, "__name__", "").startswith("torch_xla_ext")
                    and getattr(module, name, None) is original):
                setattr(module, name, getattr(owner, name))


def metric(name: str) -> tuple[int, float]:
    """torch_xla's metric `name` so far: its count of samples and their seconds."""
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return (0, 0.0) if data is None else (data[0], data[1] / 1e9)


def worker(model_type: str, layers: int | None, mode: str, passes_log: str | None) -> None:
    if passes_log:
        # Before torch_xla loads: XLA logs each HLO pass's time, to fd 2, kept in a file.
        os.environ.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="hlo_pass_pipeline=1")
        log = os.open(passes_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 2)
    import warnings

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import transformers

    import sweep_configs
    import torch_xla_ext as tx

    depth = layers or transformers.AutoConfig.for_model(
        model_type).get_text_config().num_hidden_layers
    config, _ = sweep_configs.small_config(model_type, depth)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="batched_mm",
        dtype=torch.float32)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, sweep_configs.input_id_limit(vocab), (BATCH, sweep_configs.SEQUENCE))
    device = torch_xla.device()
    model.to(device).train()
    ids = ids.to(device)
    clock = StageClock()
    if mode == "converted":
        tx.stack_layers(model)
        instrument(clock)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    figures = {"type": model_type, "layers": depth}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            (compiles_before, compile_before), (_, run_before) = (metric("CompileTime"),
                                                                  metric("ExecuteTime"))
            started = time.perf_counter()
            loss = model(ids, labels=ids).loss
            if step == 0:
                figures["while loops"] = torch_xla._XLAC._get_xla_tensors_hlo(
                    [loss]).count(" while(")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch_xla.sync()
            xm.wait_device_ops()
            seconds = time.perf_counter() - started
            if step == 0:
                (compiles, compile_seconds), (_, run_seconds) = (metric("CompileTime"),
                                                                 metric("ExecuteTime"))
                figures.update({"first step s": seconds,
                                "XLA compile s": compile_seconds - compile_before,
                                "run s": run_seconds - run_before,
                                "compiles": compiles - compiles_before,
                                "loss": loss.item()})
            else:
                figures["second step s"] = seconds
    figures["stages s"] = dict(clock.seconds)
    figures["stage calls"] = dict(clock.calls)
    figures["layer by layer"] = sorted({str(each.message)[:160] for each in caught
                                        if issubclass(each.category,
                                                      tx.layer_stack.LayerByLayerWarning)})
    ours = sum(clock.seconds.values())
    outside = figures["first step s"] - figures["XLA compile s"] - figures["run s"]
    figures["ours s"] = ours
    figures["torch_xla tracing s"] = outside - ours
    if passes_log:
        os.fsync(2)
        figures["passes s"] = pass_times(passes_log)
    harness.report_result(figures)


def pass_times(path: str) -> dict[str, float]:
    """Seconds per HLO pass (summed over its runs) in XLA's log at `path`."""
    totals: dict[str, float] = {}
    with open(path, errors="replace") as log:
        for line in log:
            found = PASS_LINE.search(line)
            if found:
                seconds = float(found[2]) * SECONDS_PER_UNIT[found[3]]
                totals[found[1]] = totals.get(found[1], 0.0) + seconds
    return totals


# ---------------------------------------------------------------- the parent


def run_type(model_type: str, layers: int | None, passes: bool, limit: float) -> dict:
    """Each mode's figures for one type, one fresh process each."""
    figures = {}
    for mode in MODES:
        arguments = ["--worker", model_type, mode]
        if layers:
            arguments += ["--layers", str(layers)]
        log = None
        if passes:
            log = os.path.join(tempfile.mkdtemp(prefix="bench_first_step_"), f"{mode}.log")
            arguments += ["--passes-log", log]
        outcome = harness.measure(__file__, arguments, limit, f"{model_type} {mode}")
        figures[mode] = outcome.figures if outcome.ok else {"failed": outcome.status}
    return figures


def ratio(a: dict, b: dict, key: str) -> float | None:
    if "failed" in a or "failed" in b or not b.get(key):
        return None
    return a[key] / b[key]


def summary(model_type: str, rounds: list[dict]) -> list[str]:
    """The type's row cells: medians over rounds (spread in brackets)."""
    converted = [each["converted"] for each in rounds]
    unconverted = [each["unconverted"] for each in rounds]
    ok = [c for c in converted if "failed" not in c]
    depth = ok[0]["layers"] if ok else "-"

    def each(key, source):
        return [None if "failed" in s else s[key] for s in source]

    base_failed = next((u["failed"] for u in unconverted if "failed" in u), None)
    cells = [model_type, str(depth),
             median_cell([ratio(c, u, "first step s") for c, u in zip(converted, unconverted)]),
             median_cell([ratio(c, u, "XLA compile s") for c, u in zip(converted, unconverted)]),
             median_cell(each("first step s", converted), 1),
             median_cell(each("XLA compile s", converted), 1),
             median_cell(each("ours s", converted)),
             median_cell(each("torch_xla tracing s", converted)),
             base_failed and f"fails: {base_failed}" or median_cell(
                 each("first step s", unconverted), 1),
             base_failed and "-" or median_cell(each("XLA compile s", unconverted), 1),
             base_failed and "-" or median_cell(each("torch_xla tracing s", unconverted)),
             median_cell([None if "failed" in c or "failed" in u else
                          c["ours s"] / u["torch_xla tracing s"]
                          for c, u in zip(converted, unconverted)]),
             str(ok[0]["while loops"]) if ok else "-",
             "/".join(str(s[0]["compiles"]) if "failed" not in s[0] else "-"
                      for s in (converted, unconverted)),
             "; ".join(ok[0]["layer by layer"]) or "none" if ok else
             next(c["failed"] for c in converted)]
    return cells


HEADER = ("type", "layers", "first step x", "compile x", "conv first s", "conv compile s",
          "ours s", "conv tracing s", "unconv first s", "unconv compile s", "unconv tracing s",
          "ours / unconv tracing", "while loops", "compiles conv/unconv", "layer by layer")


def stage_lines(model_type: str, rounds: list[dict]) -> list[str]:
    converted = [each["converted"] for each in rounds if "failed" not in each["converted"]]
    if not converted:
        return []
    parts = []
    for label, _, _ in STAGES:
        values = [c["stages s"].get(label, 0.0) for c in converted]
        calls = converted[0]["stage calls"].get(label, 0)
        parts.append(f"{label} {statistics.median(values):.2f} s ({calls} calls)")
    return [f"  {model_type}: " + ", ".join(parts)]


def pass_lines(model_type: str, rounds: list[dict]) -> list[str]:
    lines = []
    for mode in MODES:
        figures = rounds[0][mode]
        if "failed" in figures or "passes s" not in figures:
            continue
        passes = figures["passes s"]
        total = sum(passes.values())
        top = sorted(passes.items(), key=lambda item: -item[1])[:PASSES_SHOWN]
        lines.append(f"  {model_type} {mode}: compile {figures['XLA compile s']:.2f} s, HLO "
                     f"passes {total:.2f} s, outside them {figures['XLA compile s'] - total:.2f}"
                     f" s; longest: " + ", ".join(f"{name} {seconds:.2f} s"
                                                  for name, seconds in top))
    return lines


def table(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        return "\n".join(["| " + " | ".join(HEADER) + " |",
                          "|" + "---|" * len(HEADER)] +
                         ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(str(row[i])) for row in [HEADER, *rows]) for i in range(len(HEADER) - 1)]
    return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths))
                     + "  " + row[-1] for row in [HEADER, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench_first_step.py",
        description="A converted model's first training step, stage by stage, against the "
                    "unconverted model's, at flagship layouts' default depth.")
    parser.add_argument("--types", default=",".join(FLAGSHIPS),
                        help="comma-separated model types (default: %(default)s)")
    parser.add_argument("--layers", type=harness.positive_int, default=None,
                        help="layers of every type (default: each type's default depth)")
    parser.add_argument("--rounds", type=harness.positive_int, default=1)
    parser.add_argument("--xla-passes", action="store_true",
                        help="also log and list XLA's HLO pass times")
    parser.add_argument("--markdown", action="store_true")
    harness.add_timeout_option(parser, 900.0, "each worker")
    parser.add_argument("--worker", nargs=2, metavar=("TYPE", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--passes-log", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        model_type, mode = args.worker
        worker(model_type, args.layers, mode, args.passes_log)
        return 0
    types = [each for each in args.types.split(",") if each]
    results = {model_type: [] for model_type in types}
    for round_number in range(args.rounds):
        for model_type in types:
            print(f"round {round_number + 1}: {model_type}", flush=True)
            results[model_type].append(run_type(model_type, args.layers, args.xla_passes,
                                                args.timeout))
    print(f"\nFirst training step on {harness.device_name()}, converted (stack_layers) against "
          f"unconverted; x: converted / unconverted, medians over {args.rounds} round(s), "
          f"spread in brackets:\n")
    print(table([summary(t, results[t]) for t in types], args.markdown))
    print("\nThe project's own stages of the converted first step (exclusive wall time):")
    for model_type in types:
        print("\n".join(stage_lines(model_type, results[model_type])))
    if args.xla_passes:
        print("\nXLA's HLO passes (round 1):")
        for model_type in types:
            print("\n".join(pass_lines(model_type, results[model_type])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
