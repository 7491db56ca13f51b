#!/usr/bin/env python
"""transformers' own model tests (`ModelTesterMixin`, tests/test_modeling_common.py)
on the XLA device, each family's models unconverted and converted by
`torch_xla_ext.stack_layers`: which tests the conversion breaks.

The tests are transformers' own, read at run time from the source
distribution of the installed transformers: scripts/hf_peer_sdist.py
downloads it with pip at the first run into a cache folder
($TORCH_XLA_EXT_SDIST_CACHE, by default ~/.cache/torch_xla_ext/transformers-sdist)
and ends the script saying why if it cannot. The sdist lacks the tests of
`generate()` and of export, which ModelTesterMixin's module imports: they
are not run. Each family's tiny config, inputs and test case are this
project's (scripts/hf_peer_testers.py), as transformers' test files define
theirs: Llama, Qwen3, Mistral, Gemma 3 (text: Gemma3ForCausalLM, its base
model and its sequence classifier) and Mixtral, each with its base model,
causal LM and task heads.

Every (family, mode) is a worker process of its own (scripts/harness.py,
within --timeout seconds; --jobs of them at once) that runs the family's
tests with pytest on the XLA device (`TRANSFORMERS_TEST_DEVICE=xla`, PJRT's
CPU backend unless PJRT_DEVICE says otherwise; XLA:CPU without its LLVM
optimizations, as in the test suite). In mode "converted" the worker wraps
`torch.nn.Module.to`: a transformers model moved to the XLA device is
converted by `stack_layers` first (a model already stacked, such as a copy
of a converted one, is left as it is), so the tests run as they are. A test
that moves no model there runs unconverted in both modes: the table's last
column counts the models each test converted.

The script prints each test's outcome (pass, FAIL, skip) in both modes;
the regressions (pass unconverted, fail converted) with the first line of
their error; other changes between the modes (another outcome, or another
error); why tests fail unconverted too (base failures), grouped by their
error's first line; and per family the counts of each mode.

    .venv/bin/python scripts/hf_peer_suite.py                                # every family
    .venv/bin/python scripts/hf_peer_suite.py --families llama,mixtral --tests training
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import sys

import harness  # first: it sets the default device before torch_xla is imported
import hf_peer_sdist

MODES = ("unconverted", "converted")
# Each family of --families and its test case in hf_peer_testers.py.
FAMILIES = {"llama": "LlamaModelTest", "qwen3": "Qwen3ModelTest",
            "mistral": "MistralModelTest", "gemma3": "Gemma3TextModelTest",
            "mixtral": "MixtralModelTest"}
DEFAULT_TIMEOUT = 1800
# Workers at once: each spends most of its time in one XLA compilation thread.
DEFAULT_JOBS = 2
PASS, FAIL, SKIP = "pass", "FAIL", "skip"
MESSAGE_LENGTH = 200
TESTERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_peer_testers.py")
# pytest in the worker: no cache folder written, no configuration file read
# (the worker's folder may have one), and no traceback printed (the results
# keep each error's first line).
PYTEST_OPTIONS = ("-q", "-p", "no:cacheprovider", "-p", "no:warnings", "-c", os.devnull,
                  "--tb=no", "--no-header")


# ---------------------------------------------------------------- worker side


def run_tests(family: str, mode: str, selected: list[str]) -> dict:
    """Runs the tests of `family` whose name contains one of `selected` (all
    if none) in this process; returns each test's outcome, its first error
    line (its reason, for a skip) and how many models it converted."""
    os.environ["TRANSFORMERS_TEST_DEVICE"] = "xla"  # read when testing_utils is imported
    # The tests transformers runs in a pytest process of their own
    # (`run_test_using_subprocess`) run in this one, converted in mode "converted".
    os.environ["_INSIDE_SUB_PROCESS"] = "1"
    import pytest

    conversions = ConversionCounter()
    if mode == "converted":
        conversions.convert_models_moved_to_xla()
    collector = ResultCollector(FAMILIES[family], selected, conversions)
    exit_code = pytest.main([*PYTEST_OPTIONS, "--rootdir", os.path.dirname(TESTERS), TESTERS],
                            plugins=[collector])
    if collector.collection_errors:
        raise RuntimeError("pytest could not collect the tests: "
                           + "; ".join(collector.collection_errors))
    if exit_code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED,
                         pytest.ExitCode.NO_TESTS_COLLECTED):
        raise RuntimeError(f"pytest ended with {exit_code!r}")
    return collector.results


class ConversionCounter:
    """How many models `stack_layers` converted, once its wrapper is on."""

    def __init__(self):
        self.count = 0

    def convert_models_moved_to_xla(self) -> None:
        """Wraps `torch.nn.Module.to`: a transformers model moved to the XLA
        device, whose layers are not stacked yet, is converted first."""
        import torch
        from transformers import PreTrainedModel

        import torch_xla_ext as tx
        from torch_xla_ext.hf import StackedLayers

        unwrapped = torch.nn.Module.to

        def to(module, *args, **kwargs):
            device = torch._C._nn._parse_to(*args, **kwargs)[0]  # as Module.to reads them
            if (isinstance(module, PreTrainedModel) and device is not None
                    and device.type == "xla"
                    and not any(isinstance(each, StackedLayers) for each in module.modules())):
                tx.stack_layers(module)
                self.count += 1
            return unwrapped(module, *args, **kwargs)

        torch.nn.Module.to = to


class ResultCollector:
    """A pytest plugin: keeps only the tests of one test case (and of
    `selected`), and each one's result."""

    def __init__(self, test_case: str, selected: list[str], conversions: ConversionCounter):
        self.test_case = test_case
        self.selected = selected
        self.conversions = conversions
        self.results: dict[str, dict] = {}
        self.collection_errors: list[str] = []
        self._converted_before = 0

    def pytest_collection_modifyitems(self, config, items):
        kept = [item for item in items if item.cls is not None
                and item.cls.__name__ == self.test_case
                and (not self.selected or any(part in item.name for part in self.selected))]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept

    def pytest_collectreport(self, report):
        if report.failed:
            self.collection_errors.append(f"{report.nodeid}: {first_line(report)}")

    def pytest_runtest_setup(self, item):
        self._converted_before = self.conversions.count

    def pytest_runtest_logreport(self, report):
        """Each phase's report (and each failing subtest's): a test fails if
        any of them failed, and is skipped if one skipped and none failed."""
        name = report.nodeid.rpartition("::")[2]
        result = self.results.setdefault(name, {"outcome": PASS, "message": "", "converted": 0})
        result["converted"] = self.conversions.count - self._converted_before
        if report.failed and result["outcome"] != FAIL:
            result.update(outcome=FAIL, message=first_line(report))
        elif report.skipped and result["outcome"] == PASS:
            result.update(outcome=SKIP, message=first_line(report))


def first_line(report) -> str:
    """The first line of a failed report's error, or of a skip's reason."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        text = longrepr[2].removeprefix("Skipped: ")
    elif getattr(longrepr, "reprcrash", None) is not None:
        text = longrepr.reprcrash.message
    else:
        text = str(longrepr)
    return (text.strip().splitlines() or [""])[0][:MESSAGE_LENGTH]


# ---------------------------------------------------------------- the report


def comparison(results: dict[str, dict]) -> dict[str, list]:
    """The tests of one family, by how their outcomes compare across the
    modes (`results` maps each mode to its tests' results): `base_failures`
    (fail unconverted) with the unconverted error; `regressions` (pass
    unconverted, fail converted) with the converted error; `other_changes`
    (any other outcome or error that differs, a base failure's too) with both
    outcomes and the converted error or reason."""
    unconverted, converted = (results[mode] for mode in MODES)
    found = {"regressions": [], "base_failures": [], "other_changes": []}
    for name, before in unconverted.items():
        after = converted.get(name)
        if before["outcome"] == FAIL:
            found["base_failures"].append((name, before["message"]))
        if after is None:
            found["other_changes"].append((name, f"{before['outcome']} -> not run"))
        elif before["outcome"] == PASS and after["outcome"] == FAIL:
            found["regressions"].append((name, after["message"]))
        elif before["outcome"] != after["outcome"] or before["message"] != after["message"]:
            change = f"{before['outcome']} -> {after['outcome']}"
            found["other_changes"].append(
                (name, f"{change}: {after['message']}" if after["message"] else change))
    return found


def counts(tests: dict[str, dict]) -> str:
    tally = collections.Counter(result["outcome"] for result in tests.values())
    return f"{tally[PASS]} pass, {tally[FAIL]} fail, {tally[SKIP]} skip"


def print_report(results: dict[str, dict[str, dict]], markdown: bool) -> None:
    """`results`: each family's results by mode (the families that gave both)."""
    from torch_xla_ext.metrics.table import render_rows

    rows: list = [["test", "family", *MODES, "models converted"], None]
    for family, by_mode in results.items():
        unconverted, converted = (by_mode[mode] for mode in MODES)
        for name in dict.fromkeys([*unconverted, *converted]):
            cells = [unconverted.get(name), converted.get(name)]
            rows.append([name, family, *(each["outcome"] if each else "-" for each in cells),
                         str(cells[1]["converted"]) if cells[1] else "-"])
    print(render_rows(rows, markdown=markdown))
    compared = {family: comparison(by_mode) for family, by_mode in results.items()}
    for kind, heading in (("regressions", "regressions (pass unconverted, fail converted)"),
                          ("other_changes", "other changes between the modes")):
        listed = [(family, name, text) for family, found in compared.items()
                  for name, text in found[kind]]
        print(f"\n{heading}: {len(listed)}")
        for family, name, text in listed:
            print(f"  {family} {name}: {text}")
    reasons = collections.defaultdict(list)
    for family, found in compared.items():
        for name, message in found["base_failures"]:
            reasons[message].append(f"{family} {name}")
    print(f"\nbase failures (fail unconverted too), by reason: "
          f"{sum(map(len, reasons.values()))}")
    for message, tests in sorted(reasons.items(), key=lambda item: -len(item[1])):
        print(f"  {len(tests)}: {message}\n      {', '.join(tests)}")
    print()
    for family, by_mode in results.items():
        modes = "; ".join(f"{mode} {counts(by_mode[mode])}" for mode in MODES)
        print(f"{family}: {modes}; {len(compared[family]['regressions'])} regressions")


# ---------------------------------------------------------------- command line


def family_list(text: str) -> list[str]:
    """argparse type of --families: comma-separated names of FAMILIES."""
    chosen = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [name for name in chosen if name not in FAMILIES]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown families {unknown}; choose from "
                                         f"{', '.join(FAMILIES)}")
    return chosen


def main(argv=None) -> None:
    parser = harness.benchmark_parser(__file__, __doc__)
    parser.add_argument("--families", type=family_list, default=list(FAMILIES),
                        help=f"comma-separated families (default {','.join(FAMILIES)})")
    parser.add_argument("--tests", action="append", default=[], metavar="SUBSTRING",
                        help="run only the tests whose name contains SUBSTRING (repeat the "
                             "option for several)")
    parser.add_argument("--family", choices=FAMILIES, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=harness.positive_int, default=DEFAULT_JOBS,
                        help=f"worker processes at once (default {DEFAULT_JOBS})")
    harness.add_worker_options(parser, DEFAULT_TIMEOUT, "family's mode")
    args = parser.parse_args(argv)
    if args.worker:
        harness.report_result({"tests": run_tests(args.family, args.mode, args.tests)})
        return
    try:
        tests = hf_peer_sdist.ensure_tests()
    except hf_peer_sdist.SdistUnavailable as error:
        sys.exit(f"{parser.prog}: error: {error}")
    harness.compile_fast()  # as the test suite compiles: the results, not times, are read
    script = os.path.abspath(__file__)
    chosen = " or ".join(map(repr, args.tests)) or "all"
    print(f"{harness.device_name()}: transformers' ModelTesterMixin tests ({chosen}) from "
          f"{tests}, each family and mode in a process of its own", flush=True)
    selection = [argument for part in args.tests for argument in ("--tests", part)]
    runs = [(family, mode) for family in args.families for mode in MODES]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        started = {run: pool.submit(harness.measure, script,
                                    ["--worker", "--family", run[0], "--mode", run[1],
                                     *selection], args.timeout, f"{run[0]} {run[1]}")
                   for run in runs}
        outcomes = {run: future.result() for run, future in started.items()}
    results = {family: {mode: outcomes[family, mode].figures["tests"] for mode in MODES}
               for family in args.families
               if all(outcomes[family, mode].ok for mode in MODES)}
    print_report(results, args.markdown)
    harness.exit_on_problems(parser.prog, [harness.failure_summary(
        {f"{family} {mode}": outcome for (family, mode), outcome in outcomes.items()})])


if __name__ == "__main__":
    sys.exit(main())
