"""scripts/harness.py: benchmark workers in fresh processes, with a time limit."""
import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import harness  # noqa: E402

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


def test_bench_layers_reports_each_timed_out_run_and_goes_on():
    # Half a second is too little for a worker to import torch_xla: every run times out.
    completed = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_layers.py"), "--layers", "1,2", "--modes", "loop",
         "--steps", "3", "--timeout", "0.5"], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 1
    lines = completed.stdout.splitlines()
    assert "  loop L=1: timed out after 0.5 s; the end of its output:" in lines
    assert lines[lines.index("-" * 88) + 1:][:2] == ["loop               1  timed out after 0.5 s",
                                                    "loop               2  timed out after 0.5 s"]
    assert completed.stderr.splitlines()[-1] == (
        "bench_layers.py: error: 2 of 2 runs gave no figures: loop L=1 (timed out after 0.5 s), "
        "loop L=2 (timed out after 0.5 s)")
