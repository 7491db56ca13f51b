import os

import pytest

from isolated import ForkServer, call_source

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
# The suite's time is XLA:CPU compiling thousands of tiny graphs. Three
# settings change how fast a kernel is compiled or runs, not what it computes:
# no LLVM optimizations, and fusions emitted by XLA:CPU's elemental emitter
# instead of its MLIR fusion emitters (slow to compile), cut that time about
# threefold; one LLVM module per graph instead of parts compiled in threads of
# their own (each test worker has one core: the threads only contend) another
# eighth of test_hf_layer_kinds' CPU time. XLA's HLO passes, which the HLO
# tests read, still run. A caller's own setting wins.
for flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
             "--xla_cpu_parallel_codegen_split_count=1"):
    if flag.partition("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), flag]))


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
