import os

import pytest

from isolated import ForkServer

# Tests run on PJRT's CPU backend unless the caller chose a device; the package
# itself never chooses one.
os.environ.setdefault("PJRT_DEVICE", "CPU")
# XLA:CPU keeps each compiled graph's kernels in memory mappings of their own
# (about three a kernel; a graph of a few layers has hundreds), and torch_xla
# keeps its compiled graphs: the suite compiles thousands, and at Linux's limit
# of 65530 mappings (vm.max_map_count) a process dies in its next mmap ("LLVM
# compilation error: Cannot allocate memory", or a segfault). Keeping the last
# 128 graphs bounds the mappings; no test reuses an older one.
os.environ.setdefault("XLA_COMPILATION_CACHE_SIZE", "128")
# The suite's time is XLA:CPU compiling thousands of tiny graphs, half of it in
# LLVM's optimizations, which change how fast a kernel runs but not what it
# computes (XLA's HLO passes, which the HLO tests read, still run).
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]))


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
