#!/usr/bin/env python
"""A benchmark worker's figures at an earlier commit and in the working
tree, side by side: whether a change made something slower.

    python scripts/bench_before_after.py --base ce9bcfd --rounds 3 -- \
        bench_hf.py --mode stack_layers --layers 32

runs `scripts/<script> --worker <worker arguments>` (each in a fresh process)
alternately with the library of `--base` (its tree from `git archive`, with
this checkout's built C++ extension: the two must have the same csrc/) and
with this checkout's, `--rounds` times, and prints each figure's median over
the rounds on both sides with its spread (min-max), and the median of the
rounds' after/before ratios, with theirs. Alternating keeps the machine's
drift out of the ratios.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def base_tree(revision: str, folder: str) -> str:
    """The tree of `revision` in `folder`, with this checkout's C++ extension."""
    changed = subprocess.run(["git", "diff", "--quiet", revision, "--", "csrc", "setup.py"],
                             cwd=ROOT).returncode
    if changed:
        sys.exit(f"bench_before_after.py: csrc/ or setup.py differ between {revision} and the "
                 f"working tree; this script reuses the built extension, so it compares only "
                 f"commits with the same C++ code")
    archive = subprocess.run(["git", "archive", revision], cwd=ROOT, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    built = glob.glob(os.path.join(ROOT, "torch_xla_ext", "_C*.so"))
    if not built:
        sys.exit("bench_before_after.py: no built extension (torch_xla_ext/_C*.so): run "
                 "bash scripts/setup.sh first")
    shutil.copy(built[0], os.path.join(folder, "torch_xla_ext"))
    return folder


def run_in(tree: str, script: str, arguments: list[str], limit: float) -> dict:
    """The worker's figures, run with the library of `tree`."""
    environment = {**os.environ, "PYTHONPATH": tree, "PJRT_DEVICE": "CPU"}
    process = subprocess.run([sys.executable, os.path.join(tree, "scripts", script),
                              "--worker", *arguments], capture_output=True, text=True,
                             env=environment, cwd=tree, timeout=limit)
    outcome = harness.worker_outcome(process.returncode, process.stdout, process.stderr, 0.0,
                                     limit)
    if not outcome.ok:
        sys.exit(outcome.failure_report(f"{script} in {tree}"))
    return outcome.figures


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.4g} ({min(values):.4g}-{max(values):.4g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the earlier commit")
    parser.add_argument("--rounds", type=harness.positive_int, default=3)
    parser.add_argument("--timeout", type=harness.time_limit, default=900,
                        help="seconds for each worker")
    parser.add_argument("script", help="a benchmark script of scripts/ (bench_hf.py)")
    parser.add_argument("arguments", nargs=argparse.REMAINDER,
                        help="the worker's arguments (--mode stack_layers --layers 32)")
    args = parser.parse_args()
    rounds: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as folder:
        trees = {"before": base_tree(args.base, folder), "after": ROOT}
        for number in range(1, args.rounds + 1):
            for side, tree in trees.items():
                rounds[side].append(run_in(tree, args.script, args.arguments, args.timeout))
                print(f"round {number}: {side} done", flush=True)
    print(f"\n{args.script} {' '.join(args.arguments)}: {args.base} (before) against the "
          f"working tree (after), {args.rounds} rounds")
    print(f"{'figure':<16} {'before':>28} {'after':>28} {'after/before':>24}")
    for name, first in rounds["before"][0].items():
        if not isinstance(first, (int, float)) or isinstance(first, bool):
            continue
        before = [each[name] for each in rounds["before"]]
        after = [each[name] for each in rounds["after"]]
        ratios = [a / b for a, b in zip(after, before) if b]
        print(f"{name:<16} {spread(before):>28} {spread(after):>28} "
              f"{spread(ratios) if ratios else '-':>24}")


if __name__ == "__main__":
    main()
