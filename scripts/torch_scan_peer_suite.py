#!/usr/bin/env python
"""torch's own test cases of its scan operator, run on the XLA device: how many
pass with torch's own kernels, and how many with `register_torch_scan()`.

torch's scan operator (`torch._higher_order_ops.scan.scan`) runs unrolled on
torch_xla; registered, `torch_xla_ext` runs it as one While loop each way.
This suite asks whether the registered operator still does what torch's tests
ask of it. The cases are torch's, written as this project's code in
scripts/torch_scan_peer_cases.py (torch_scan_peer_checks.py holds the
reference loop and the comparisons):

* `hop_db_simple`: the `scan` OpInfo of `torch.testing._internal.hop_db`
  (installed with torch): its sample input and function, in its dtypes that
  XLA multiplies (float32, float16, int64).
* every other group: the scan tests of `TestControlFlow` in pytorch's
  test/functorch/test_control_flow.py (in pytorch's repository, not in the
  wheel), each group named after the tests it follows: `compile`, `dtype`,
  `dim`, `binary_operator`, `tuple`, `complex_pytree`, `downstream`,
  `non_pointwise`, `init`, `init_pytree_complex`, `closure_RNN`,
  `closure_RNN_partial_autograd`, `closure_no_grad` (the
  closure_combine_fn_with_no_grad tests), `closure_nested`,
  `y_less_ndim_than_dim`, `multiple_layers_gradient`, `compile_cnt`, and
  `errors` (the tests that expect an error: the same class must be raised on
  the device as on the CPU). Their parameters are torch's: `reverse`,
  `autograd` (gradients checked too) and `compiled` (torch's compile mode
  "eager", `torch.compile(scan, backend="eager")`; "none" when False; its
  inductor modes do not target XLA). Where torch draws shapes or masks at
  random, fixed ones stand in. Each case compares with a Python for loop on
  the same device (values, and gradients with `autograd`), as torch's compare
  with their Python reference.

Each of the two runs, unregistered then registered, is a worker process of
its own (scripts/harness.py, within --timeout seconds), which runs every case
(`torch._dynamo.reset()` and a seed of its own before each) and reports which
passed. The script prints a row per case, what failed and why, and per run
how many cases passed.

    .venv/bin/python scripts/torch_scan_peer_suite.py                   # all cases
    .venv/bin/python scripts/torch_scan_peer_suite.py --cases closure_  # names containing it
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import harness  # first: it sets the default device before torch_xla is imported

RUNS = ("unregistered", "registered")
DEFAULT_TIMEOUT = 3600
PASS = "pass"


def run_cases(run: str, selected: list[str]) -> dict:
    """Every case whose name contains one of `selected` (all if none), in this
    process; returns each one's result: PASS, or what it raised."""
    import torch
    import torch_xla

    import torch_scan_peer_cases  # noqa: F401 (registers the cases)
    import torch_xla_ext as tx
    from torch_scan_peer_checks import CASES

    if run == "registered":
        tx.register_torch_scan()
    results = {}
    for seed, (name, check) in enumerate(CASES.items()):
        if selected and not any(part in name for part in selected):
            continue
        torch._dynamo.reset()
        torch.manual_seed(seed)
        try:
            check()
            torch_xla.sync()
            results[name] = PASS
        except Exception as error:  # a failing case is a result, whatever it raised
            first_line = (str(error).strip().splitlines() or [""])[0]
            results[name] = f"{type(error).__name__}: {first_line[:160]}"
    return results


def print_report(outcomes: dict, markdown: bool) -> None:
    from torch_xla_ext.metrics.table import render_rows

    results = {run: outcome.figures["cases"] for run, outcome in outcomes.items()}
    names = list(dict.fromkeys(name for cases in results.values() for name in cases))
    rows = [["case", *outcomes], None,
            *([name, *(_short(results[run].get(name)) for run in outcomes)] for name in names)]
    print(render_rows(rows, markdown=markdown))
    for run, cases in results.items():
        reasons = collections.Counter(result for result in cases.values() if result != PASS)
        if reasons:
            print(f"\n{run}: why cases failed (number of cases)")
            for reason, count in reasons.most_common():
                print(f"  {count:4d}  {reason}")
    print()
    for run, cases in results.items():
        passed = sum(result == PASS for result in cases.values())
        print(f"{run}: {passed} of {len(cases)} cases pass")


def _short(result: str | None) -> str:
    if result is None:
        return "-"
    return PASS if result == PASS else "FAIL " + result.split(":")[0]


def main(argv=None) -> None:
    parser = harness.benchmark_parser(__file__, __doc__)
    parser.add_argument("--cases", action="append", default=[], metavar="SUBSTRING",
                        help="run only the cases whose name contains SUBSTRING (repeat the "
                             "option for several)")
    parser.add_argument("--run", choices=RUNS, help=argparse.SUPPRESS)
    harness.add_worker_options(parser, DEFAULT_TIMEOUT, "run")
    args = parser.parse_args(argv)
    if args.worker:
        harness.report_result({"cases": run_cases(args.run, args.cases)})
        return
    script = os.path.abspath(__file__)
    chosen = " or ".join(map(repr, args.cases)) or "all"
    print(f"{harness.device_name()}: torch's scan test cases ({chosen}), each run in a process "
          f"of its own", flush=True)
    selection = [argument for part in args.cases for argument in ("--cases", part)]
    outcomes = {run: harness.measure(script, ["--worker", "--run", run, *selection],
                                     args.timeout, f"run {run!r}") for run in RUNS}
    harness.exit_on_problems(parser.prog, [harness.failure_summary(outcomes)])
    print_report(outcomes, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
