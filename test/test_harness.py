"""scripts/harness.py: benchmark workers in fresh processes, with a time limit."""
import argparse
import os
import re
import subprocess
import sys
import textwrap

import pytest

import torch_xla_ext.metrics as metrics
from benchmark_scripts import SCRIPTS, forked_workers, op_times_rows  # noqa: F401 (a fixture)
import bench_layers
import harness

TIME_LIMIT = 1.5
# Plain Python workers: no torch to import, so each starts in a fraction of a second.
WORKERS = {
    "reports": """
        import sys
        sys.path.insert(0, {scripts!r})
        import harness
        print("a line of the workload's own")
        harness.report_result({{"answer": 42, "seconds": 0.5}})
    """,
    "sleeps": """
        import subprocess, sys, time
        # A child of its own that holds the output pipes open: stopping the
        # worker alone would leave the parent waiting for it.
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print("started", flush=True)
        time.sleep(120)
    """,
    "raises": """
        import sys
        for line in range(1, 41):
            print(f"log line {{line}}", file=sys.stderr)
        raise ValueError("the workload broke at step 3")
    """,
    "prints nothing": """
        print("no result line")
    """,
    "crashes": """
        import os, signal
        os.kill(os.getpid(), signal.SIGSEGV)
    """,
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Each worker's outcome, run one after the other as the scripts run them."""
    directory = tmp_path_factory.mktemp("workers")
    results = {}
    for name, source in WORKERS.items():
        script = directory / f"{name.replace(' ', '_')}.py"
        script.write_text(textwrap.dedent(source.format(scripts=str(SCRIPTS))))
        results[name] = harness.run_worker(str(script), [], TIME_LIMIT)
    return results


def test_a_reporting_worker_gives_its_figures(outcomes):
    outcome = outcomes["reports"]
    assert outcome.ok and outcome.status == "ok"
    assert outcome.figures == {"answer": 42, "seconds": 0.5}


def test_a_worker_over_its_time_limit_is_stopped_and_reported_as_timed_out(outcomes):
    outcome = outcomes["sleeps"]
    assert not outcome.ok and outcome.figures is None
    assert outcome.status == "timed out after 1.5 s"
    # Stopped with its child: run_worker returned soon after the limit.
    assert TIME_LIMIT <= outcome.seconds < TIME_LIMIT + 10
    assert outcome.output_tail == "started"


def test_a_failing_worker_gives_the_end_of_its_error_output(outcomes):
    outcome = outcomes["raises"]
    assert not outcome.ok and outcome.status == "exit code 1"
    tail = outcome.output_tail.splitlines()
    assert len(tail) == harness.OUTPUT_TAIL_LINES
    assert tail[-1] == "ValueError: the workload broke at step 3"
    assert "log line 40" in tail and "log line 1" not in tail
    report = outcome.failure_report("mode 'scan'")
    assert report.startswith("mode 'scan': exit code 1; the end of its output:\n")
    assert report.endswith("ValueError: the workload broke at step 3")


def test_a_worker_without_a_result_line_or_killed_gives_no_figures(outcomes):
    assert outcomes["prints nothing"].status == "no result printed"
    assert outcomes["prints nothing"].output_tail == "no result line"
    assert outcomes["crashes"].status == "killed by SIGSEGV"
    assert not outcomes["crashes"].ok


def test_the_table_goes_on_after_a_timed_out_worker(outcomes):
    table = harness.outcome_table(
        {"first": outcomes["reports"], "slow": outcomes["sleeps"],
         "last": harness.Outcome({"answer": 50}, "ok", "", 0.1)},
        rows=[("answer", "the answer", "")], baseline="first")
    assert table.splitlines() == [
        "figure          first                     slow    last",
        "worker process     ok    timed out after 1.5 s      ok",
        "the answer         42                        -      50 *",
        "* differs from first by more than 10%",
    ]


def test_no_status_row_when_every_worker_gave_figures(outcomes):
    table = harness.outcome_table({"first": outcomes["reports"]},
                                  rows=[("answer", "the answer", "")], baseline="first")
    assert table.splitlines() == ["figure      first", "the answer     42"]


def test_failure_summary_names_the_runs_without_figures(outcomes):
    assert harness.failure_summary({"loop": outcomes["reports"]}) is None
    assert harness.failure_summary(
        {"loop": outcomes["reports"], "scan": outcomes["sleeps"], "other": outcomes["raises"]}
    ) == ("2 of 3 runs gave no figures: scan (timed out after 1.5 s), other (exit code 1)")


@pytest.mark.parametrize("text, problem", [("0", "must be more than 0 seconds"),
                                           ("-3", "must be more than 0 seconds"),
                                           ("soon", "is not a number of seconds")])
def test_time_limit_must_be_positive_seconds(text, problem):
    with pytest.raises(argparse.ArgumentTypeError, match=problem):
        harness.time_limit(text)
    assert harness.time_limit("2.5") == 2.5


@pytest.mark.parametrize("chosen, expected", [(None, "CPU"), ("TPU", "TPU")])
def test_workers_run_on_the_users_device_cpu_by_default(tmp_path, chosen, expected):
    worker = tmp_path / "device.py"
    worker.write_text("import json, os\n"
                      f"print({harness.RESULT_PREFIX!r} + json.dumps(os.environ['PJRT_DEVICE']))\n")
    parent = ("import harness\n"
              f"print(harness.device_name(), harness.run_worker({str(worker)!r}, [], 60).figures)")
    environment = {name: value for name, value in os.environ.items() if name != "PJRT_DEVICE"}
    if chosen is not None:
        environment["PJRT_DEVICE"] = chosen
    completed = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True,
                               timeout=60, cwd=SCRIPTS, env=environment)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == [expected, expected]


def test_bench_layers_reports_each_timed_out_run_and_goes_on(capsys):
    # Half a second is too little for a worker to import torch_xla: every run times out.
    with pytest.raises(SystemExit) as exited:
        bench_layers.main(["--layers", "1,2", "--modes", "loop", "--steps", "3",
                           "--timeout", "0.5"])
    # A message for sys.exit: printed to stderr, exit code 1.
    assert exited.value.code == (
        "bench_layers.py: error: 2 of 2 runs gave no figures: loop L=1 (timed out after 0.5 s), "
        "loop L=2 (timed out after 0.5 s)")
    lines = capsys.readouterr().out.splitlines()
    assert "  loop L=1: timed out after 0.5 s; the end of its output:" in lines
    rule = next(index for index, line in enumerate(lines) if set(line) == {"-"})
    assert lines[rule - 1].split() == ["mode", "L", "python", "ms", "compile", "s", "compiles",
                                       "exec", "ms", "exec", "cpu", "ms", "peak", "RSS", "MiB",
                                       "params", "MiB"]
    assert lines[rule + 1:rule + 3] == ["loop  1  timed out after 0.5 s",
                                        "loop  2  timed out after 0.5 s"]


def test_bench_layers_prints_markdown_tables_with_markdown(capsys):
    with pytest.raises(SystemExit):
        bench_layers.main(["--layers", "1", "--modes", "loop,scan", "--steps", "3",
                           "--timeout", "0.5", "--markdown"])
    lines = capsys.readouterr().out.splitlines()
    header = lines.index("| mode | L | python ms | compile s | compiles | exec ms | exec cpu ms "
                         "| peak RSS MiB | params MiB |")
    assert lines[header + 1:header + 4] == [
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        "| loop | 1 | timed out after 0.5 s |  |  |  |  |  |  |",
        "| scan | 1 | timed out after 0.5 s |  |  |  |  |  |  |"]
    ratios = lines.index("| ratio | value | goal | verdict |")
    assert lines[ratios + 1] == "|---|---:|---:|---:|"
    assert lines[ratios + 2] == "| python time scan/loop at L=1 | n/a (missing run) |  |  |"


def test_time_steps_times_build_and_finish_apart_after_an_untimed_prepare(monkeypatch):
    calls = []
    monkeypatch.setattr(metrics, "reset_peak_rss", lambda: calls.append("reset") or True)
    monkeypatch.setattr(harness.time, "perf_counter", lambda: len(calls))
    # CPU time: 10 s per finish.
    monkeypatch.setattr(harness.time, "process_time", lambda: 10 * calls.count("finish"))

    def build():
        calls.extend(["build"] * 2)
        return len(calls)

    times = harness.time_steps(3, build, lambda: calls.append("finish"),
                               prepare=lambda step: calls.append(f"prepare {step}"))
    # The peak restarts after the last step's prepare (which releases memory).
    assert calls == ["prepare 0", "build", "build", "finish",
                     "prepare 1", "build", "build", "finish",
                     "prepare 2", "reset", "build", "build", "finish"]
    assert times.build == [2, 2, 2] and times.finish == [1, 1, 1]
    assert times.finish_cpu == [10, 10, 10]
    assert times.total == [3, 3, 3]
    assert times.peak_is_last_steps and times.last_built == 12


def test_ratio_lines_against_their_goals():
    figures = {("scan", 8): {"ms": 2.0}, ("loop", 8): {"ms": 10.0, "zero": 0}}
    assert harness.ratio(figures, ("scan", 8), ("loop", 8), "ms") == 0.2
    assert harness.ratio(figures, ("scan", 8), ("loop", 32), "ms") is None
    assert harness.ratio(figures, ("loop", 8), ("loop", 8), "zero") is None
    assert harness.goal_line("scan/loop", 0.2, 0.2, width=12) == (
        "  scan/loop     0.200   goal <= 0.2   ok")
    assert harness.goal_line("scan/loop", 0.25, 0.2, width=12) == (
        "  scan/loop     0.250   goal <= 0.2   MISSED")
    assert harness.goal_line("scan/loop", None, 0.2, width=12) == (
        "  scan/loop    n/a (missing run)")


def test_goal_lines_of_at_least_a_value():
    assert harness.verdict(0.5, 0.5, minimum=True) == "ok"
    assert harness.verdict(0.4, 0.5, minimum=True) == "MISSED"
    assert harness.goal_line("of limit", 0.8, 0.5, width=12, minimum=True) == (
        "  of limit      0.800   goal >= 0.5   ok")
    assert harness.goal_line("of limit", 0.3, 0.5, width=12, spread=(0.2, 0.4),
                             minimum=True) == (
        "  of limit      0.300   goal >= 0.5   MISSED (0.200-0.400)")


def test_workers_are_given_the_parents_options():
    args = argparse.Namespace(steps=5, kv_heads=2, intermediate=None, op_times=True, quick=False)
    assert harness.passed_on(args, ("steps", "kv_heads", "intermediate", "op_times", "quick")) == [
        "--steps", "5", "--kv-heads", "2", "--op-times"]


def layer_and_mode_parser():
    parser = harness.benchmark_parser("bench.py", "a benchmark")
    harness.add_layer_and_mode_options(parser, ["loop", "scan"])
    parser.add_argument("--steps", type=int, default=3)
    return parser


@pytest.mark.parametrize("argv, layers, modes", [
    ([], [8, 32, 64], ["loop", "scan"]),
    (["--quick"], [2, 4], ["loop", "scan"]),
    (["--layers", "3,5", "--modes", "scan"], [3, 5], ["scan"]),
])
def test_layers_and_modes_chosen_on_the_command_line(argv, layers, modes):
    parser = layer_and_mode_parser()
    args = parser.parse_args(argv)
    assert harness.chosen_runs(parser, args, ["loop", "scan"], warmup_steps=2) == (layers, modes)


@pytest.mark.parametrize("argv, error", [
    (["--modes", "loop,bogus"], "unknown modes ['bogus']; choose from loop, scan"),
    (["--steps", "2"], "--steps must exceed the 2 warm-up steps"),
])
def test_unknown_modes_and_too_few_steps_are_refused(argv, error, capsys):
    parser = layer_and_mode_parser()
    with pytest.raises(SystemExit) as exited:
        harness.chosen_runs(parser, parser.parse_args(argv), ["loop", "scan"], warmup_steps=2)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"bench.py: error: {error}"


def test_ratios_over_rounds_are_their_median_with_the_spread():
    assert harness.median_and_spread([1.2, 0.9, 1.0]) == (1.0, (0.9, 1.2))
    assert harness.median_and_spread([1.0]) == (1.0, None)
    assert harness.median_and_spread([1.0, None]) == (None, None)
    assert harness.goal_line("scan/loop", 1.0, 1.1, width=12, spread=(0.9, 1.2)) == (
        "  scan/loop     1.000   goal <= 1.1   ok     (0.900-1.200)")
    rounds = [{"scan": {"ms": ms}, "loop": {"ms": 10.0}} for ms in (12.0, 9.0, 10.0)]
    assert harness.goal_over_rounds("scan/loop", rounds, "scan", "loop", "ms", 1.1) == (
        harness.Goal("scan/loop", 1.0, 1.1, spread=(0.9, 1.2)))
    assert harness.goal_over_rounds("scan/loop", [*rounds, {}], "scan", "loop", "ms",
                                    1.1) == harness.Goal("scan/loop", None, 1.1)
    # As text, the goal lines with their labels padded alike.
    assert harness.goal_table([harness.Goal("scan/loop", 1.0, 1.1, spread=(0.9, 1.2)),
                               harness.Goal("compile scan/loop", None, 0.5)]).splitlines() == [
        harness.goal_line("scan/loop", 1.0, 1.1, width=17, spread=(0.9, 1.2)),
        harness.goal_line("compile scan/loop", None, 0.5, width=17)]


def test_markdown_tables_of_runs_and_of_ratios(capsys):
    outcomes = {("loop", 8): harness.Outcome({"ms": 10.0}, harness.OK, "", 1.0),
                ("scan", 8): harness.Outcome({"ms": 2.5}, harness.OK, "", 1.0),
                ("scan", 32): harness.Outcome(None, "timed out after 9 s", "", 9.0)}
    harness.print_runs_table(outcomes, [("time ms", lambda r: f"{r['ms']:.1f}")], markdown=True)
    # A header row, the separator row (the first column left-aligned, the
    # numbers right-aligned), one row per run; a run without figures shows its
    # status in its first figure's cell.
    assert capsys.readouterr().out.splitlines() == [
        "| mode | L | time ms |",
        "|---|---:|---:|",
        "| loop | 8 | 10.0 |",
        "| scan | 8 | 2.5 |",
        "| scan | 32 | timed out after 9 s |"]
    goals = [harness.Goal("scan/loop at L=8", 0.25, 0.2, spread=(0.2, 0.3)),
             harness.Goal("scan/loop at L=32", None, 0.2)]
    assert harness.goal_table(goals, markdown=True).splitlines() == [
        "| ratio | median | spread | goal | verdict |",
        "|---|---:|---:|---:|---:|",
        "| scan/loop at L=8 | 0.250 | 0.200-0.300 | <= 0.2 | MISSED |",
        "| scan/loop at L=32 | n/a (missing run) |  |  |  |"]
    # One round: its value, no spread column.
    assert harness.goal_table([harness.Goal("a|b", 0.1, 0.2)], markdown=True).splitlines() == [
        "| ratio | value | goal | verdict |",
        "|---|---:|---:|---:|",
        "| a\\|b | 0.100 | <= 0.2 | ok |"]


@pytest.mark.parametrize("argv, error", [
    (["--block", "ours,gpt"], "unknown blocks ['gpt']; choose from ours, fused_qkv_sdpa, llama"),
    (["--rounds", "0"], "argument --rounds: '0' must be 1 or more"),
    (["--unroll", "1,0"], "argument --unroll: '0' must be 1 or more"),
    (["--modes", "loop", "--unroll", "2,4"],
     "--unroll 2,4 is for mode scan, which --modes leaves out; add scan to --modes"),
])
def test_bench_layers_refuses_unknown_blocks_and_no_rounds_before_any_run(argv, error, capsys):
    with pytest.raises(SystemExit) as exited:
        bench_layers.main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"bench_layers.py: error: {error}"


def test_bench_layers_measures_the_scan_at_each_unroll_beside_the_loop(forked_workers, capsys):
    bench_layers.main(["--layers", "3", "--modes", "loop,scan", "--unroll", "1,2", "--steps", "3",
                       "--hidden", "16", "--heads", "2", "--seq", "4", "--batch", "1"])
    lines = capsys.readouterr().out.splitlines()
    rule = next(index for index, line in enumerate(lines) if set(line) == {"-"})
    runs = [line.split("  3 ")[0].strip() for line in lines[rule + 1:rule + 4]]
    assert runs == ["loop", "scan", "scan unroll=2"]
    # The ratios as before, then each unroll's over the loop.
    assert any(line.startswith("  execution scan/loop at L=3 ") for line in lines)
    heading = lines.index("Unroll (layers per loop iteration), block ours, over the loop:")
    assert lines[heading + 1].split() == ["L", "unroll", "exec", "scan/loop", "fwd", "exec",
                                          "scan/loop", "compile", "scan/loop"]
    for line, unroll in zip(lines[heading + 3:heading + 5], ("1", "2")):
        number = r"\d+\.\d{3}"
        assert re.fullmatch(rf"3 +{unroll} +{number} +{number} +{number}", line), line


def test_bench_layers_op_times_shows_where_each_runs_step_time_went(forked_workers, capsys):
    bench_layers.main(["--layers", "2", "--modes", "loop,scan", "--steps", "3", "--hidden", "16",
                       "--heads", "2", "--seq", "4", "--batch", "1", "--op-times"])
    lines = capsys.readouterr().out.splitlines()
    heading = lines.index("Where a training step's time went, block ours, op by op (count and "
                          "wall ms of each kind of op, per step; last round):")
    assert lines[heading + 1].split() == ["op", "kind", "loop", "L=2", "n", "loop", "L=2", "ms",
                                          "scan", "L=2", "n", "scan", "L=2", "ms"]
    rows, busy = op_times_rows(lines, lines[heading])
    # The same matrix products in both; only the scan's loops read and write
    # slices of stacked values.
    assert rows["dot"][0] == rows["dot"][2] != "0"
    for kind in ("dynamic-slice_bitcast_fusion", "bitcast_dynamic-update-slice_fusion"):
        assert rows[kind][0] == "0" and rows[kind][2] != "0", (kind, rows[kind])
    assert all(float(ms) > 0 for ms in busy)
