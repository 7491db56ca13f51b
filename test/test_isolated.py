"""The runner of isolated scenarios (isolated.py): each scenario in its own
process, behaving as `python -c source` would, however it ends."""
import os
import subprocess
import time

import pytest


def test_a_crash_ends_only_its_scenario(run_isolated):
    crashed = run_isolated("""
        import os, signal
        print("before", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    """)
    assert crashed.returncode == -11
    assert crashed.stdout == "before\n"
    after = run_isolated("print('still serving')")
    assert (after.returncode, after.stdout) == (0, "still serving\n")


@pytest.mark.parametrize("source, returncode, stderr", [
    ("raise SystemExit(3)", 3, ""),
    ("import sys; sys.exit('a message')", 1, "a message\n"),
    ("raise KeyError('lost')", 1, "KeyError: 'lost'"),
    ("import sys; sys.stdout.write('no newline')", 0, ""),
])
def test_exit_codes_and_errors_as_python_c(run_isolated, source, returncode, stderr):
    completed = run_isolated(source)
    assert completed.returncode == returncode
    assert stderr in completed.stderr
    if returncode == 1 and "KeyError" in stderr:
        assert completed.stderr.startswith("Traceback")


def test_a_scenario_past_its_timeout_is_killed(run_isolated):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        run_isolated("""
            import subprocess, sys, time
            print("started", flush=True)
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            time.sleep(600)
        """, timeout=3)
    assert time.monotonic() - start < 30
    assert expired.value.stdout == "started\n"
    assert run_isolated("print(1)").stdout == "1\n"


def test_a_scenario_runs_as_main_with_its_environment(run_isolated):
    completed = run_isolated("""
        import atexit, os, sys, threading, time
        import reference  # test/ is on the path, as for `python -c` with PYTHONPATH
        assert __name__ == "__main__" and sys.argv == ["-c"]
        print(os.environ["ISOLATED_MARK"], os.environ["PJRT_DEVICE"])
        print("--xla_dump_hlo_as_text" in os.environ["XLA_FLAGS"].split())
        atexit.register(print, "atexit ran")
        def late():
            time.sleep(0.5)
            print("thread joined", flush=True)
        threading.Thread(target=late).start()
    """, env={"ISOLATED_MARK": "marked", "XLA_FLAGS": "--xla_dump_hlo_as_text"})
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines() == [
        "marked CPU", "True", "thread joined", "atexit ran"]


def test_a_clean_environment_replaces_the_session_one(run_isolated):
    environment = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    environment["ONLY_HERE"] = "1"
    completed = run_isolated("""
        import os
        print(os.environ.get("PJRT_DEVICE"), os.environ["ONLY_HERE"])
    """, clean_env=environment)
    assert completed.stdout == "None 1\n", completed.stderr


def test_torch_xla_ext_is_imported_afresh_by_each_scenario(run_isolated):
    source = """
        import sys
        assert "torch_xla_ext" not in sys.modules
        import torch_xla_ext
        print(sorted(name for name in sys.modules if name.startswith("torch_xla_ext"))[0])
    """
    for _ in range(2):
        completed = run_isolated(source)
        assert (completed.returncode, completed.stdout) == (0, "torch_xla_ext\n"), completed.stderr


def reports_where_it_runs(mark, exit_code):
    """A scenario function: run in the child, its module imported afresh there."""
    import sys
    print(mark, __name__, "torch_xla_ext" in sys.modules, flush=True)
    raise SystemExit(exit_code)


def test_a_scenario_function_of_a_test_module_runs_with_its_arguments(run_isolated):
    completed = run_isolated(reports_where_it_runs, args=("marked", 3))
    assert (completed.returncode, completed.stdout) == (3, "marked test_isolated False\n"), \
        completed.stderr


def test_scenario_functions_must_be_importable_and_their_arguments_literals(run_isolated):
    def nested():
        pass

    with pytest.raises(TypeError, match="top level of its module"):
        run_isolated(nested)
    with pytest.raises(TypeError, match="top level of its module"):
        run_isolated(lambda: None)
    with pytest.raises(TypeError, match="is not a literal"):
        run_isolated(reports_where_it_runs, args=(object(), 0))
    with pytest.raises(TypeError, match="args are passed to a scenario function"):
        run_isolated("print(1)", args=(1,))
