#!/usr/bin/env python
"""Sweep transformers' causal LMs: train each type unconverted and converted by
`torch_xla_ext.stack_layers`, side by side, and say what the conversion did.

Every model type of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (or those
--types names) is built from its own default config, shrunk generically
(scripts/sweep_configs.py: --layers layers, hidden 64, 4 heads, small vocab,
dropout off, float32, eager attention, experts_implementation="batched_mm"),
and trained 2 SGD steps on XLA twice from the same weights: as
transformers builds it, then after `stack_layers(model)` and `.to(device)`.
Each type runs in a fresh worker process (scripts/harness.py) within
--timeout seconds, so that a crash, a hang or an exception is that type's
outcome only.

What a worker observes, from the public API and behaviour only: whether
stack_layers refused (its exception and message), the UnstackedLayersWarning
and LayerByLayerWarning it gave (while converting and training), the XLA
While loops in the forward's graph beyond the unconverted model's (one per
scan) with the steps each runs, the decoder layers (the classes the model
names in _no_split_modules, in its layer lists) called outside a traced scan
in the second step against the unconverted model's calls, and the losses, the
gradients of the first step and the weights after the last, compared by
state_dict key within rtol 1e-4, atol 1e-4. A model whose training draws random numbers
(PhiMoE's routing; dropout is off) is trained with its modules in eval mode on
both sides, and says so: a scan draws its own random numbers.

Each type gets one outcome, a line each, then the counts:

  scanned (k scans over n of N layers)   every layer call ran inside a scan
  partly scanned (...): reason           some layers ran one by one (a warning says why)
  layer by layer: reason                 no scan ran (the warning's reason)
  refused: reason                        stack_layers raised, the model unchanged
  raised: reason                         accepted, then the converted training raised
  wrong: which values, by how much       converted results differ from the unconverted
  crashed: signal / timeout / exit code  the worker died
  base fails: reason                     the unconverted model does not build or train
                                         on XLA (not counted against the conversion)

  python scripts/sweep_causal_lm.py                        # every type, one at a time
  python scripts/sweep_causal_lm.py --types llama,gpt2 --json out.json
  python scripts/sweep_causal_lm.py --markdown --jobs 2    # the table for docs/sweep.md
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import harness  # first: it sets the default device before torch_xla is imported
from sweep_worker import BASE_PARTS, PART_MARK, STEPS, TOLERANCE

# The outcomes, in the order the counts list them.
OUTCOMES = ("scanned", "partly scanned", "layer by layer", "refused", "raised", "wrong",
            "crashed", "base fails")
DEFAULT_TIMEOUT = 900
DEFAULT_LAYERS = 4
REASON_CHARS = 160
SITE_PACKAGES = re.compile(r"/\S*/site-packages/")
# What the library's messages say before their reason proper.
PREAMBLE = re.compile(r"^stack_layers: (cannot stack the layers at '[^']*': )?"
                      r"|^The \d+ layers ran one by one[^:]*: ")


# ---------------------------------------------------------------- classification


def first_sentence(message: str, limit: int = REASON_CHARS) -> str:
    """The message's first sentence (its lines joined), its file paths from
    site-packages on, cut to `limit` characters."""
    text = SITE_PACKAGES.sub("", PREAMBLE.sub("", " ".join(message.split())))
    text = re.split(r"(?<=[.;])\s", text, maxsplit=1)[0].rstrip(".;")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def scan_summary(figures: dict) -> str:
    """'k scans over n of N layers' (steps per scan when they are not n)."""
    scans, calls, outside = figures["scans"], figures["layer_calls"], figures["calls_outside"]
    steps = [scan["steps"] for scan in scans]
    over = f"{calls - outside} of {calls} layers" if calls else "layers not counted"
    text = f"{len(scans)} scan{'s' if len(scans) != 1 else ''} over {over}"
    if sum(steps) != calls - outside:
        text += f" ({'+'.join(map(str, steps))} steps)"
    if outside and not warned(figures, "LayerByLayerWarning"):
        text += f", {outside} as {'itself' if outside == 1 else 'themselves'}"
    return text


def warned(figures: dict, category: str) -> list[str]:
    return [each["message"] for each in figures.get("warnings", [])
            if each["category"] == category]


def classify(outcome: harness.Outcome) -> tuple[str, str]:
    """A type's outcome (one of OUTCOMES) and its reason, from its worker's `outcome`."""
    figures = outcome.figures
    if figures is None:
        lines = outcome.output_tail.strip().splitlines()
        detail = f": {first_sentence(lines[-1])}" if lines and outcome.status.startswith(
            "exit") else ""
        parts = [each[len(PART_MARK):] for each in lines if each.startswith(PART_MARK)]
        if parts and parts[-1] in BASE_PARTS:
            return "base fails", f"{parts[-1]}: {outcome.status}{detail}"
        return "crashed", outcome.status + detail + (f" (in {parts[-1]})" if parts else "")
    if "base_error" in figures:
        error = figures["base_error"]
        return "base fails", f"{error['stage']}: {first_sentence(error['error'])}"
    if "refused" in figures:
        return "refused", first_sentence(figures["refused"]["message"])
    if "raised" in figures:
        return "raised", first_sentence(figures["raised"]["error"])
    wrong = [f"{what} by {diff['max_abs']:.3g} at {diff['worst']}"
             for what, diff in figures["diffs"].items() if not diff["ok"]]
    if wrong:
        return "wrong", "; ".join(wrong)
    by_layer = warned(figures, "LayerByLayerWarning") + warned(figures, "UnstackedLayersWarning")
    # No warning: the layers called outside a scan ran as themselves (runs of one layer).
    why = first_sentence(by_layer[0]) if by_layer else "each layer ran as itself, no two " \
        "neighbours alike, without a warning"
    if not figures["scans"]:
        return "layer by layer", why
    if figures["calls_outside"] and by_layer:
        return "partly scanned", f"{scan_summary(figures)}: {why}"
    # Layers called outside a scan with no warning ran as themselves: runs of one layer.
    return "scanned", scan_summary(figures)


def line(model_type: str, outcome: str, reason: str, eval_mode: bool = False) -> str:
    text = f"{outcome} ({reason})" if outcome == "scanned" else f"{outcome}: {reason}"
    return f"{model_type:<28} {text}" + (" [eval mode]" if eval_mode else "")


def header(device: str, version: str, types: int, layers: int) -> str:
    return (f"PJRT {device}, transformers {version}, {types} causal-LM types at {layers} "
            f"layers, {STEPS} SGD steps each, tolerance rtol {TOLERANCE['rtol']} atol "
            f"{TOLERANCE['atol']}")


def timed_line(result: dict) -> str:
    return f"{result['line']}   ({result['seconds']:.0f} s)"


def counts(results: dict[str, dict]) -> dict[str, int]:
    found = {name: 0 for name in OUTCOMES}
    for result in results.values():
        found[result["outcome"]] += 1
    return found


def count_lines(results: dict[str, dict]) -> list[str]:
    """The counts per outcome and the share scanned among types whose base trains."""
    found = counts(results)
    trains = len(results) - found["base fails"]
    lines = [f"{len(results)} types: " + ", ".join(f"{n} {name}" for name, n in found.items())]
    if trains:
        lines.append(f"scanned: {found['scanned']} of the {trains} types whose unconverted "
                     f"model trains on XLA ({100 * found['scanned'] / trains:.0f}%)")
    return lines


def reason_group(reason: str) -> str:
    """`reason` without what differs from type to type (details in brackets,
    quoted names, numbers, the model's class), so that types refused for the
    same reason share a row of the table."""
    text = reason.removesuffix("...")
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\s*\([^()]*\)", "", text)
    text = re.sub(r"\s*\(.*$", "", text)  # a bracket the reason's cut left open
    text = re.sub(r"\[[^\]]*\]?", "[...]", text)
    text = re.sub(r"'[^'\s]*'|`[^`]*`", "'...'", text)
    text = re.sub(r"\b\w+\.forward\b", "<model>.forward", text)
    text = re.sub(r"\bin [A-Z]\w+", "in <model>", text)
    return re.sub(r"\b\d+(\.\d+)?\b", "N", text)


def markdown_table(results: dict[str, dict]) -> str:
    """Outcomes grouped by reason (`reason_group`, but the scanned by their
    scans): | outcome | reason | types |."""
    from torch_xla_ext.metrics.table import render_rows

    groups: dict[tuple[str, str], list[str]] = {}
    for model_type, result in results.items():
        reason = result["reason"] if result["outcome"] == "scanned" else reason_group(
            result["reason"])
        groups.setdefault((result["outcome"], reason), []).append(model_type)
    rows: list = [["outcome", "reason", "types"]]
    for (outcome, reason), types in sorted(
            groups.items(), key=lambda item: (OUTCOMES.index(item[0][0]), -len(item[1]))):
        rows.append([outcome, reason.replace("|", "\\|"), f"{len(types)}: {', '.join(types)}"])
    return render_rows(rows, markdown=True)


# ---------------------------------------------------------------- parent


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def chosen_types(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    every = causal_lm_types()
    chosen = args.types.split(",") if args.types else every
    excluded = args.exclude.split(",") if args.exclude else []
    unknown = sorted(set(chosen + excluded) - set(every))
    if unknown:
        parser.error(f"unknown model types {unknown}: not in transformers' "
                     f"MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    return [each for each in chosen if each not in excluded]


def sweep_type(model_type: str, layers: int, timeout: float) -> dict:
    """One type's worker, run: its result (`result_of`)."""
    return result_of(model_type, harness.run_worker(
        os.path.abspath(__file__), ["--worker", "--types", model_type, "--layers", str(layers)],
        timeout))


def result_of(model_type: str, outcome: harness.Outcome) -> dict:
    """A type's outcome, reason and line, with what its worker gave."""
    kind, reason = classify(outcome)
    eval_mode = bool(outcome.figures and outcome.figures.get("eval_mode"))
    return {"outcome": kind, "reason": reason, "line": line(model_type, kind, reason, eval_mode),
            "seconds": round(outcome.seconds, 1), "worker": outcome.status,
            "figures": outcome.figures, "output_tail": None if outcome.ok else outcome.output_tail}


def saved_results(path: str) -> tuple[dict, dict[str, dict]]:
    """A --json file's contents, and its results classified again from their figures."""
    with open(path) as file:
        saved = json.load(file)
    return saved, {model_type: result_of(model_type, harness.Outcome(
        result["figures"], result["worker"], result["output_tail"] or "", result["seconds"]))
        for model_type, result in saved["results"].items()}


def print_summary(results: dict[str, dict], minutes: float, markdown: bool) -> None:
    print()
    for text in count_lines(results):
        print(text)
    print(f"the sweep took {minutes:.1f} minutes")
    if markdown:
        print("\n" + markdown_table(results))


def save(path: str, results: dict[str, dict], minutes: float, layers: int,
         commands: list[str]) -> None:
    """Writes a sweep's results, and how it was made, to `path` as JSON."""
    import transformers

    with open(path, "w") as file:
        json.dump({"commands": commands, "device": harness.device_name(),
                   "transformers": transformers.__version__, "layers": layers, "steps": STEPS,
                   "tolerance": TOLERANCE, "minutes": round(minutes, 1),
                   "counts": counts(results), "results": results}, file, indent=1)


def main(argv: list[str] | None = None) -> None:
    parser = harness.benchmark_parser(__file__, __doc__)
    parser.add_argument("--types", default=None,
                        help="comma-separated model types (default: every causal-LM type)")
    parser.add_argument("--exclude", default=None, help="comma-separated model types to skip")
    parser.add_argument("--layers", type=harness.positive_int, default=DEFAULT_LAYERS,
                        help=f"decoder layers of each model (default {DEFAULT_LAYERS})")
    parser.add_argument("--jobs", type=harness.positive_int, default=1,
                        help="workers run at once (default 1)")
    saved_as = parser.add_mutually_exclusive_group()
    saved_as.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    saved_as.add_argument("--update", metavar="FILE",
                          help="run --types again in the sweep saved in FILE (by --json): "
                               "replace their results there, then print and save the whole")
    saved_as.add_argument("--report", metavar="FILE",
                          help="run nothing: print the lines and counts of the sweep saved in "
                               "FILE, each type classified again from its figures")
    harness.add_worker_options(parser, DEFAULT_TIMEOUT, "type")
    args = parser.parse_args(argv)
    if args.worker:
        from sweep_worker import run_type

        harness.report_result(run_type(args.types, args.layers))
        return

    if args.report:
        saved, results = saved_results(args.report)
        print(f"{args.report}: " + header(saved["device"], saved["transformers"], len(results),
                                          saved["layers"]))
        for result in results.values():
            print(timed_line(result))
        print_summary(results, saved["minutes"], args.markdown)
        return
    types = chosen_types(parser, args)
    saved, results = saved_results(args.update) if args.update else ({}, {})
    if args.update and saved["layers"] != args.layers:
        parser.error(f"{args.update} is a sweep at {saved['layers']} layers; pass --layers "
                     f"{saved['layers']}")
    # XLA:CPU's LLVM optimizations make kernels faster and compile longer: the
    # sweep's models are tiny, so it runs without them, as the test suite does
    # (its two sides then come out bit-identical where their graphs compute the
    # same; with them, they differ by roundings, within TOLERANCE).
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
    import transformers

    print(header(harness.device_name(), transformers.__version__, len(types), args.layers),
          flush=True)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for model_type, result in zip(types, pool.map(
                lambda each: sweep_type(each, args.layers, args.timeout), types)):
            results[model_type] = result
            print(timed_line(result), flush=True)
    minutes = (time.perf_counter() - started) / 60 + saved.get("minutes", 0)
    if args.update:
        print(f"\n{args.update}, updated:")
        for result in results.values():
            print(timed_line(result))
    print_summary(results, minutes, args.markdown)
    if args.json or args.update:
        command = " ".join(["scripts/sweep_causal_lm.py", *(argv or sys.argv[1:])])
        save(args.json or args.update, results, minutes, args.layers,
             [*saved.get("commands", []), command])


if __name__ == "__main__":
    main()
