import os
import subprocess
import sys
import textwrap

import pytest

# Tests run on PJRT's CPU backend unless the caller chose a device; the package
# itself never chooses one.
os.environ.setdefault("PJRT_DEVICE", "CPU")


@pytest.fixture
def run_isolated():
    """Runs Python source in a fresh interpreter (so a crash cannot take the
    test session down) and returns the completed process."""

    def run(source: str, timeout: float = 240, env: dict | None = None,
            clean_env: dict | None = None):
        """`env` adds to the test environment (on PJRT CPU); `clean_env`, if
        given, is the whole environment instead."""
        environment = clean_env if clean_env is not None else {
            **os.environ, "PJRT_DEVICE": "CPU", **(env or {})}
        # The shared reference (reference.py) is importable in the subprocess too.
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [os.path.dirname(__file__), environment.get("PYTHONPATH")]))
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True,
            timeout=timeout, env=environment)

    return run
