"""The C++ core: its plain C++ unit tests in test/csrc, and its work seen from
Python (the registry of live placeholders, the parameter plans of scan).

Each test/csrc/*_test.cc is a Bazel cc_test (BUILD). Bazel builds them once
(`scripts/test.sh` runs `bazel test //...` first, so here the build is cached);
these tests run the built binaries and check that none is left out of BUILD.
"""
import gc
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch_xla

import torch_xla_ext as tx
from torch_xla_ext.scan.loop import lower_body
from torch_xla_ext.scan.signature import Slot, SlotKind

DEV = torch_xla.device()
ROOT = Path(__file__).resolve().parent.parent
TEST_SOURCES = sorted(p.name for p in (ROOT / "test" / "csrc").glob("*_test.cc"))
BAZEL = ["bash", str(ROOT / "scripts" / "bazel.sh")]


def _bazel(*arguments: str) -> subprocess.CompletedProcess:
    completed = subprocess.run([*BAZEL, *arguments], capture_output=True, text=True,
                               timeout=1800, cwd=ROOT)
    if completed.returncode != 0:
        pytest.fail(f"bazel {' '.join(arguments)} failed (exit {completed.returncode}):\n"
                    f"{completed.stdout}{completed.stderr[-5000:]}", pytrace=False)
    return completed


@pytest.fixture(scope="session")
def csrc_test_binaries():
    """{test source name: the binary Bazel built from it}."""
    targets = [f"//:{Path(name).stem}" for name in TEST_SOURCES]
    _bazel("build", *targets)
    bin_directory = Path(_bazel("info", "bazel-bin").stdout.strip())
    return {name: bin_directory / Path(name).stem for name in TEST_SOURCES}


def test_every_csrc_test_is_a_bazel_test():
    assert "placeholder_data_test.cc" in TEST_SOURCES
    assert "parameter_table_test.cc" in TEST_SOURCES
    build = (ROOT / "BUILD").read_text()
    declared = re.findall(r'"test/csrc/(\w+_test\.cc)"', build)
    assert sorted(declared) == TEST_SOURCES, "each test/csrc/*_test.cc needs a cc_test in BUILD"
    for name in TEST_SOURCES:
        assert f'name = "{Path(name).stem}"' in build


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
    for _ in range(10):
        train_step()
        with torch.no_grad():
            tx.scan(block, init, xs)
    torch_xla.sync()
    assert tx.cache_info().misses == 1 and tx.cache_info().hits == 21
    assert tx._C.ids_issued() - issued_before == issued_by_trace  # no stand-in per call
    assert _new_live_ids(before) == set()
    tx.cache_clear()
    assert _new_live_ids(before) == set()


def test_lowered_body_plans_parameters_by_placeholder_id_and_handle():
    carry, x, weight = tx.placeholder((2,)), tx.placeholder((2,)), tx.placeholder((2,))
    constant = torch.tensor([0.0, 1.0]).to(DEV)  # device data
    unread = tx.placeholder((2,))
    stand_ins = {"carry": (carry, Slot(SlotKind.CARRY, 0)),
                 "x": (x, Slot(SlotKind.SLICED, 0)),
                 "weight": (weight, Slot(SlotKind.INVARIANT, 0)),
                 "unread": (unread, Slot(SlotKind.INVARIANT, 1))}
    body = lower_body("plan", [carry * weight + x * constant + x], stand_ins, invariant_count=2)
    planned = dict(zip(body.parameters, body.inputs))
    assert len(body.parameters) == len(body.inputs) == 4
    assert planned[("placeholder", tx.placeholder_id(carry))] == Slot(SlotKind.CARRY, 0)
    assert planned[("placeholder", tx.placeholder_id(x))] == Slot(SlotKind.SLICED, 0)
    assert planned[("placeholder", tx.placeholder_id(weight))] == Slot(SlotKind.INVARIANT, 0)
    constant_key = ("device_data", torch_xla._XLAC._get_tensors_handle([constant])[0])
    assert planned[constant_key] == Slot(SlotKind.INVARIANT, 2)  # after the given invariants
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
                          {0: (second, Slot(SlotKind.CARRY, 0)),
                           1: (first, Slot(SlotKind.SLICED, 0))}, 0)
        keys = {Slot(SlotKind.SLICED, 0): tx.placeholder_id(first),
                Slot(SlotKind.CARRY, 0): tx.placeholder_id(second)}
        plans.append(all(key == ("placeholder", keys[slot])
                         for key, slot in zip(body.parameters, body.inputs)))
        ids.update(keys.values())
        del first, second, body
    assert len(addresses) < 60, "no address came back: this test would show nothing"
    assert all(plans) and len(ids) == 60


def unlifted_placeholder_scenario():
    """A step reading a placeholder of a class scan does not lift is refused; scan goes on."""
    import warnings
    import torch_xla.core.xla_builder as xb
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


def test_step_reading_a_placeholder_it_cannot_bind_raises(run_isolated):
    result = run_isolated(unlifted_placeholder_scenario)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused" in result.stdout
