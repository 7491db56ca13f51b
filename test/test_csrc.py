"""The C++ core: its plain C++ unit tests in test/csrc, and its work seen from
Python (the registry of live placeholders, the parameter plans of scan).

Each test/csrc/*_test.cc becomes one binary, linked with the csrc sources and
torch's libc10/libtorch_cpu, built with g++ in a pytest temporary directory.
All translation units compile in parallel (one job per core), once per session.
"""
import gc
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch_xla

import torch_xla_ext as tx
from torch_xla_ext.scan.loop import Slot, lower_body

DEV = torch_xla.device()
ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
TEST_CSRC = ROOT / "test" / "csrc"
CORE_SOURCES = ["placeholder_data.cc", "parameter_table.cc"]
TEST_SOURCES = sorted(p.name for p in TEST_CSRC.glob("*_test.cc"))
CXX = os.environ.get("CXX", "g++")


def _torch_build_flags():
    import torch
    from torch.utils import cpp_extension

    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    compile_flags = ["-std=c++17", "-O1", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                     f"-I{CSRC}", f"-I{TEST_CSRC}"]
    compile_flags += [f"-I{path}" for path in cpp_extension.include_paths()]
    link_flags = []
    for path in cpp_extension.library_paths():
        link_flags += [f"-L{path}", f"-Wl,-rpath,{path}"]
    link_flags += ["-lc10", "-ltorch_cpu", "-pthread"]
    return compile_flags, link_flags


def _run(cmd, timeout=300):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _check_built(proc, what):
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (exit {proc.returncode}):\n$ {' '.join(proc.args)}\n"
                    f"{proc.stdout}{proc.stderr}", pytrace=False)


@pytest.fixture(scope="session")
def csrc_test_binaries(tmp_path_factory):
    """Compiles every translation unit in parallel, then links one binary per
    test file. Returns {test source name: binary path}."""
    if shutil.which(CXX) is None:
        pytest.skip(f"no C++ compiler ({CXX}) on PATH")
    out = tmp_path_factory.mktemp("csrc_tests")
    compile_flags, link_flags = _torch_build_flags()
    sources = [CSRC / name for name in CORE_SOURCES] + [TEST_CSRC / name for name in TEST_SOURCES]
    objects = {src: out / (src.stem + ".o") for src in sources}

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(
            lambda src: _run([CXX, *compile_flags, "-c", str(src), "-o", str(objects[src])]),
            sources))
    for src, proc in zip(sources, results):
        _check_built(proc, f"compiling {src.relative_to(ROOT)}")

    core_objects = [str(objects[CSRC / name]) for name in CORE_SOURCES]
    binaries = {}
    for name in TEST_SOURCES:
        binary = out / Path(name).stem
        proc = _run([CXX, str(objects[TEST_CSRC / name]), *core_objects, *link_flags,
                     "-o", str(binary)])
        _check_built(proc, f"linking {name}")
        binaries[name] = binary
    print(f"[test_csrc] built {len(binaries)} C++ test binaries in "
          f"{time.monotonic() - start:.1f}s", file=sys.stderr)
    return binaries


def test_csrc_tests_exist():
    assert "placeholder_data_test.cc" in TEST_SOURCES
    assert "parameter_table_test.cc" in TEST_SOURCES


@pytest.mark.parametrize("source", TEST_SOURCES)
def test_csrc(source, csrc_test_binaries):
    binary = csrc_test_binaries[source]
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"{source} exited with {proc.returncode}; its output:\n{output}")
    assert "checks passed" in output, output


# ---------------------------------------------------------------------------
# The core at work: the registry of live placeholders, and the parameter plan
# of every body scan lowers.

def _new_live_ids(before: set) -> set:
    gc.collect()
    return {p.id for p in tx.live_placeholders()} - before


def test_live_placeholders_lists_what_is_alive():
    before = {p.id for p in tx.live_placeholders()}
    a, b = tx.placeholder((2, 3), torch.bfloat16), tx.placeholder((), torch.int32)
    derived = a * 2
    listed = [p for p in tx.live_placeholders() if p.id not in before]
    assert listed == [
        tx.LivePlaceholder(tx.placeholder_id(a), torch.bfloat16, (2, 3),
                           f"bfloat16[2,3] placeholder #{tx.placeholder_id(a)}"),
        tx.LivePlaceholder(tx.placeholder_id(b), torch.int32, (),
                           f"int32[] placeholder #{tx.placeholder_id(b)}")]
    del a, b, listed
    # The tensor computed from `a` keeps it alive; the listing itself keeps nothing.
    assert len(_new_live_ids(before)) == 1
    del derived
    assert _new_live_ids(before) == set()


def test_cached_scan_calls_leave_no_placeholder_alive():
    # What the cache holds for a trace: HLO computations, each body's parameter
    # plan and device-data constants. The stand-ins of a trace die with it.
    lin = torch.nn.Linear(4, 4).to(DEV)
    norm = torch.nn.LayerNorm(4).to(DEV)

    def block(h, x):
        h = norm(torch.tanh(lin(h)) + x)
        return h, torch.nn.functional.dropout(h, 0.1).sum(-1)

    init = torch.randn(2, 4, device=DEV, requires_grad=True)
    xs = torch.randn(3, 2, 4, device=DEV)
    tx.cache_clear()
    gc.collect()
    before = {p.id for p in tx.live_placeholders()}
    issued_before = tx._C.ids_issued()

    def train_step():
        carry, ys = tx.scan(block, init, xs)
        (carry.sum() + ys.sum()).backward()

    train_step()  # the trace: forward and backward loops
    with torch.no_grad():
        tx.scan(block, init, xs)  # the inference loop
    issued_by_trace = tx._C.ids_issued() - issued_before
    assert issued_by_trace > 0 and _new_live_ids(before) == set()
    for _ in range(50):
        train_step()
        with torch.no_grad():
            tx.scan(block, init, xs)
    torch_xla.sync()
    assert tx.cache_info().misses == 1 and tx.cache_info().hits == 101
    assert tx._C.ids_issued() - issued_before == issued_by_trace  # no stand-in per call
    assert _new_live_ids(before) == set()
    tx.cache_clear()
    assert _new_live_ids(before) == set()


def test_lowered_body_plans_parameters_by_placeholder_id_and_handle():
    carry, x, weight = tx.placeholder((2,)), tx.placeholder((2,)), tx.placeholder((2,))
    constant = torch.tensor([0.0, 1.0]).to(DEV)  # device data
    unread = tx.placeholder((2,))
    stand_ins = {"carry": (carry, Slot("carry", 0)), "x": (x, Slot("sliced", 0)),
                 "weight": (weight, Slot("invariant", 0)), "unread": (unread, Slot("invariant", 1))}
    body = lower_body("plan", [carry * weight + x * constant + x], stand_ins, invariant_count=2)
    planned = dict(zip(body.parameters, body.inputs))
    assert len(body.parameters) == len(body.inputs) == 4
    assert planned[("placeholder", tx.placeholder_id(carry))] == Slot("carry", 0)
    assert planned[("placeholder", tx.placeholder_id(x))] == Slot("sliced", 0)
    assert planned[("placeholder", tx.placeholder_id(weight))] == Slot("invariant", 0)
    constant_key = ("device_data", torch_xla._XLAC._get_tensors_handle([constant])[0])
    assert planned[constant_key] == Slot("invariant", 2)  # after the given invariants
    assert len(body.constants) == 1 and body.constants[0].cpu().tolist() == [0.0, 1.0]
    assert ("placeholder", tx.placeholder_id(unread)) not in planned


def test_plans_stay_right_when_torch_xla_reuses_placeholder_addresses():
    # Stand-ins made and freed one lowering after another: torch_xla's keys
    # (addresses) may come back, the core's ids never do.
    ids, addresses, plans = set(), set(), []
    for step in range(30):
        first, second = tx.placeholder((3,)), tx.placeholder((3,))
        addresses.update(torch_xla._XLAC._get_tensors_handle([first, second]))
        body = lower_body(f"reuse{step}", [first - second],
                          {0: (second, Slot("carry", 0)), 1: (first, Slot("sliced", 0))}, 0)
        keys = {Slot("sliced", 0): tx.placeholder_id(first),
                Slot("carry", 0): tx.placeholder_id(second)}
        plans.append(all(key == ("placeholder", keys[slot])
                         for key, slot in zip(body.parameters, body.inputs)))
        ids.update(keys.values())
        del first, second, body
    assert len(addresses) < 60, "no address came back: this test would show nothing"
    assert all(plans) and len(ids) == 60


UNLIFTED_PLACEHOLDER = """
import warnings
import torch, torch_xla
import torch_xla.core.xla_builder as xb
import torch_xla_ext as tx
warnings.simplefilter("ignore")
dev = torch_xla.device()

class Tagged(torch.Tensor):  # a class scan does not lift as a capture
    pass

weight = xb.create_placeholder_tensor((4,), torch.float32)
weight.__class__ = Tagged
try:
    tx.scan(lambda c, x: (c + x * weight, None), torch.zeros(4, device=dev),
            torch.ones(3, 4, device=dev))
except ValueError as error:
    assert "reads a float32[4] placeholder" in str(error), str(error)
else:
    raise AssertionError("scan ran a step that reads a placeholder it cannot bind")
carry, _ = tx.scan(lambda c, x: (c + x, None), torch.zeros(4, device=dev),
                   torch.ones(3, 4, device=dev))
assert carry.cpu().tolist() == [3.0] * 4
print("refused")
"""


def test_step_reading_a_placeholder_it_cannot_bind_raises(run_isolated):
    result = run_isolated(UNLIFTED_PLACEHOLDER)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused" in result.stdout
