import os
import sys

import pytest

from isolated import ForkServer, call_source

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)
import harness  # noqa: E402 (the scripts' folder first)

# Tests run on PJRT's CPU backend unless the caller chose a device; the package
# itself never chooses one.
os.environ.setdefault("PJRT_DEVICE", "CPU")
# The suite's time is XLA:CPU compiling thousands of tiny graphs: the settings
# that compile them faster, and the bound on torch_xla's compiled graphs that
# keeps a process under Linux's limit of memory mappings (harness.compile_fast
# says why each); no test reuses an older graph.
harness.compile_fast()


@pytest.fixture(scope="session")
def scenario_server():
    server = ForkServer(dict(os.environ))
    yield server
    server.close()


@pytest.fixture
def run_isolated(scenario_server):
    """Runs Python source in its own process (so a crash cannot take the test
    session down) and returns the completed process (see isolated.py)."""

    def run(scenario, timeout: float = 240, env: dict | None = None,
            clean_env: dict | None = None, args: tuple = ()):
        """`scenario` is Python source, or a function defined at the top level
        of a test module, called with `args` (literals). `env` adds to the test
        environment (on PJRT CPU); `clean_env`, if given, is the whole
        environment instead."""
        environment = clean_env if clean_env is not None else {
            **os.environ, "PJRT_DEVICE": "CPU", **(env or {})}
        # The shared helpers (reference.py, tolerances.py) are importable in
        # the scenario too, and so is a scenario function's module.
        folders = [os.path.dirname(__file__)]
        if isinstance(scenario, str):
            if args:
                raise TypeError("args are passed to a scenario function, not to source")
            source = scenario
        else:
            source, module_folder = call_source(scenario, args)
            folders.append(module_folder)
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [*dict.fromkeys(folders), environment.get("PYTHONPATH")]))
        return scenario_server.run(source, timeout=timeout, env=environment)

    return run


@pytest.fixture(scope="session")
def device():
    """The XLA device the tests run on."""
    import torch_xla
    return torch_xla.device()


@pytest.fixture(autouse=True)
def device_random_state_reset():
    """Each test starts from the same random state of the XLA device, no draw
    of an earlier test pending. torch_xla composes the seed of each random
    draw on the device from the previous one until a sync, so without this
    every graph drawing random numbers carried the seeds of every earlier
    draw in the process since its last sync: compiled anew for each test (its
    graph never the same) and longer as the suite went (test_scan.py took
    four times as long after a test that drew 1000 modules' weights)."""
    import torch_xla.core.xla_model as xm
    xm.set_rng_state(0)
