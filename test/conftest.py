import os

import pytest

from isolated import ForkServer

# Tests run on PJRT's CPU backend unless the caller chose a device; the package
# itself never chooses one.
os.environ.setdefault("PJRT_DEVICE", "CPU")


@pytest.fixture(scope="session")
def scenario_server():
    server = ForkServer(dict(os.environ))
    yield server
    server.close()


@pytest.fixture
def run_isolated(scenario_server):
    """Runs Python source in its own process (so a crash cannot take the test
    session down) and returns the completed process (see isolated.py)."""

    def run(source: str, timeout: float = 240, env: dict | None = None,
            clean_env: dict | None = None):
        """`env` adds to the test environment (on PJRT CPU); `clean_env`, if
        given, is the whole environment instead."""
        environment = clean_env if clean_env is not None else {
            **os.environ, "PJRT_DEVICE": "CPU", **(env or {})}
        # The shared reference (reference.py) is importable in the scenario too.
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [os.path.dirname(__file__), environment.get("PYTHONPATH")]))
        return scenario_server.run(source, timeout=timeout, env=environment)

    return run
