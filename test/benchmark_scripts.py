"""The benchmark scripts (scripts/) as tests run them: imported as modules, so
that their command lines run in pytest's process (`main(argv)`), and their
workers forked from the scenario server (isolated.py), which has torch_xla
imported already, instead of started as new interpreters (about 10 s each)."""
import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))
import harness  # noqa: E402

# `python SCRIPT ARGUMENTS...` in the parent's directory: the script's directory
# first on the import path, then this checkout's torch_xla_ext.
WORKER_SOURCE = """
import os, runpy, sys
os.chdir({cwd!r})
sys.path[:0] = [{scripts!r}, {repo!r}]
sys.argv = [{script!r}, *{arguments!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def forked_run_worker(scenario_server):
    """`harness.run_worker`, its worker forked from `scenario_server`; a worker
    past its time limit fails the test (subprocess.TimeoutExpired)."""

    def run_worker(script, arguments, limit):
        started = time.perf_counter()
        source = WORKER_SOURCE.format(cwd=os.getcwd(), scripts=str(SCRIPTS), repo=str(REPO),
                                      script=script, arguments=list(arguments))
        done = scenario_server.run(source, timeout=limit, env=dict(os.environ))
        return harness.worker_outcome(done.returncode, done.stdout, done.stderr,
                                      time.perf_counter() - started, limit)

    return run_worker


@pytest.fixture
def forked_workers(scenario_server, monkeypatch):
    """The scripts' workers run forked from the scenario server while the test runs."""
    monkeypatch.setattr(harness, "run_worker", forked_run_worker(scenario_server))


def worker_figures(scenario_server, script: str, *arguments: str) -> dict:
    """The figures `script --worker ARGUMENTS...` reports, run forked."""
    outcome = forked_run_worker(scenario_server)(str(SCRIPTS / script),
                                                 ["--worker", *arguments], 600)
    assert outcome.ok, outcome.failure_report(script)
    return outcome.figures


def op_times_rows(lines: list[str], heading: str) -> tuple[dict[str, list[str]], list[str]]:
    """The table `harness.print_op_times` printed after `heading`: each kind's
    cells (a count and ms per run), and the busy ms of each run (checked to
    be the time one op ran alone plus the time two or more ran at once)."""
    start = lines.index(heading)
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("all ops (busy)"))
    runs = (len(lines[start + 3].split()) - 1) // 2
    rows = {}
    for line in lines[start + 3:end]:
        if set(line) <= {"-"} or line.startswith("other kinds"):
            continue
        kind, *cells = line.rsplit(None, 2 * runs)
        rows[kind] = cells
    busy = lines[end].split()[-runs:]
    alone, together = (lines[end + offset].rsplit(None, runs) for offset in (1, 2))
    assert (alone[0], together[0]) == ("1 op running", "2 or more at once")
    for run in range(runs):
        parts = float(alone[1 + run]) + float(together[1 + run])
        assert abs(parts - float(busy[run])) <= 0.11, (busy, alone, together)
    return rows, busy
