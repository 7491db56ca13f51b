import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met

import torch_xla_ext as tx
from torch_xla_ext.metrics import hlo_parameter_count, peak_rss_bytes, reset_peak_rss


def hlo_of(*tensors):
    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))


def describe(placeholder):
    """The C++ core's description of a placeholder, which every message uses."""
    return tx._C.find_placeholder(tx.placeholder_id(placeholder)).describe()


@pytest.mark.parametrize("dtype", tx.placeholders.SUPPORTED_DTYPES)
def test_placeholder_has_shape_dtype_and_no_buffer(dtype):
    p = tx.placeholder((2, 3), dtype)
    assert p.shape == (2, 3) and p.dtype == dtype and p.device.type == "xla"
    assert tx.is_placeholder(p)
    assert not tx.is_placeholder(torch.zeros(2, device="xla"))
    assert not tx.is_placeholder(torch.zeros(2))


def test_shape_forms_and_requires_grad():
    assert tx.placeholder(5).shape == (5,)
    assert tx.placeholder(torch.Size([0, 4])).shape == (0, 4)
    assert tx.placeholder(()).shape == ()
    assert tx.placeholder((2,), requires_grad=True).requires_grad


def test_tracing_costs_no_transfer_and_no_memory():
    met.clear_all()
    reset_peak_rss()
    rss_before = peak_rss_bytes()
    side = 16384  # 16384 x 16384 float32 = 1 GiB
    for _ in range(100):
        p = tx.placeholder((side, side))
        hlo = hlo_of((p @ p).sum())
        assert "dot(" in hlo
    rss_growth = peak_rss_bytes() - rss_before
    assert "TransferToDeviceTime" not in met.metric_names()
    assert rss_growth < 100 * 2**20, f"RSS grew by {rss_growth / 2**20:.1f} MiB"


def test_one_parameter_per_placeholder():
    p = tx.placeholder((3, 3))
    assert hlo_parameter_count(hlo_of(p + p * p)) == 1
    q1, q2 = tx.placeholder((3, 3)), tx.placeholder((3, 3))
    assert hlo_parameter_count(hlo_of(q1 + q2)) == 2


def test_ids_are_never_reused():
    ids = set()
    for _ in range(10_000):
        p = tx.placeholder((4, 4))
        ids.add(tx.placeholder_id(p))
        del p
    assert len(ids) == 10_000


def test_ids_come_from_the_cpp_core():
    p = tx.placeholder((2,), torch.int32)
    data = tx._C.find_placeholder(tx.placeholder_id(p))
    assert data is not None and data.sizes == [2] and data.dtype == torch.int32
    assert not data.has_value()
    with pytest.raises(tx.PlaceholderError, match="cannot assign a value"):
        data.assign()


def test_placeholder_id_rejects_other_tensors():
    with pytest.raises(ValueError, match="placeholder_id"):
        tx.placeholder_id(torch.zeros(2, device="xla"))
    with pytest.raises(ValueError, match="float32\\[2\\] tensor"):
        tx.placeholder_id(tx.placeholder((2,)) + 1)


READERS = {
    "cpu": lambda t: t.cpu(),
    "item": lambda t: t.item(),
    "tolist": lambda t: t.tolist(),
    "numpy": lambda t: t.numpy(),
    "repr": repr,
    "print": print,
    "to_cpu": lambda t: t.to("cpu"),
    "float": lambda t: float(t.sum()),
}


@pytest.mark.parametrize("reader", READERS.values(), ids=READERS.keys())
@pytest.mark.parametrize("derived", [False, True], ids=["placeholder", "computed"])
def test_reading_raises_placeholder_error_naming_the_tensor(reader, derived):
    p = tx.placeholder((4, 2), torch.bfloat16)
    t = (p * 2).sum(0) if derived else p
    with pytest.raises(tx.PlaceholderError) as error:
        reader(t)
    message = str(error.value)
    assert isinstance(error.value, RuntimeError)
    assert describe(p) == f"bfloat16[4,2] placeholder #{tx.placeholder_id(p)}"
    assert describe(p) in message
    assert "no data" in message


def test_tensors_not_reading_placeholder_data_stay_readable():
    p = tx.placeholder((3,))
    assert torch.zeros_like(p).cpu().tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad_shape, error, match", [
    ((2, -1), ValueError, r"shape\[1\] must be non-negative, got -1"),
    ((2, 1.5), TypeError, r"shape\[1\] must be an int, got 1.5"),
    ((True,), TypeError, r"shape\[0\] must be an int"),
    ("ab", TypeError, "shape must be a sequence of ints"),
    (None, TypeError, "shape must be a sequence of ints"),
])
def test_bad_shapes(bad_shape, error, match):
    with pytest.raises(error, match=match):
        tx.placeholder(bad_shape)


def test_bad_dtype_and_device():
    with pytest.raises(ValueError, match="dtype torch.float8_e4m3fn is not supported"):
        tx.placeholder((2,), torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype, got 'float32'"):
        tx.placeholder((2,), "float32")
    with pytest.raises(ValueError, match="must be an XLA device .* got cpu"):
        tx.placeholder((2,), device="cpu")
    with pytest.raises(TypeError, match="device must be a torch.device"):
        tx.placeholder((2,), device=3.5)
    with pytest.raises(ValueError, match="requires_grad=True needs a floating point"):
        tx.placeholder((2,), torch.int32, requires_grad=True)


# The two ways to sync, by the name a test gives.
SYNCS = {"torch_xla.sync()": torch_xla.sync, "xm.mark_step()": xm.mark_step}


def sync_scenario(sync: str):
    """Work pending on placeholders, and real work, then a sync (SYNCS[sync])."""
    import warnings
    warnings.simplefilter("ignore")

    p = tx.placeholder((4, 4))
    real = torch.ones(4, 4, device="xla")
    weight = torch.ones(4, 4, device="xla", requires_grad=True)
    torch_xla.sync()
    pending = {
        "computed": p * 2 + real,
        "in_place": torch.zeros(4, 4, device="xla").add_(p),
    }
    loss = (p @ weight).relu().sum()
    loss.backward()
    pending["gradient"] = weight.grad
    pending["loss"] = loss
    good = real * 3
    SYNCS[sync]()
    for name, tensor in pending.items():
        try:
            tensor.cpu()
        except tx.PlaceholderError as error:
            assert "placeholder #" in str(error), str(error)
        else:
            raise AssertionError(name + " was readable")
    assert good.cpu().sum().item() == 48.0
    later = good + 1
    SYNCS[sync]()
    assert later.cpu().sum().item() == 64.0
    print("survived")


@pytest.mark.parametrize("sync", ["torch_xla.sync()", "xm.mark_step()"])
def test_sync_with_pending_placeholder_work_never_crashes(run_isolated, sync):
    result = run_isolated(sync_scenario, args=(sync,))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "survived" in result.stdout


def failed_op_scenario():
    """An op that fails on placeholders midway (matmul's shapes disagree after
    it expanded them), then what a traceback printer does: show every tensor
    the traceback's frames hold; then a sync, and real work after it."""
    import warnings
    from torch.utils._pytree import tree_flatten
    warnings.simplefilter("ignore")

    p, q = tx.placeholder((2, 4, 16, 32)), tx.placeholder((2, 1, 8, 16))
    try:
        torch.matmul(p, q)
    except RuntimeError as error:
        failed = error
    held, entry = [], failed.__traceback__
    while entry is not None:
        held += [leaf for value in entry.tb_frame.f_locals.values()
                 for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]
        entry = entry.tb_next
    computed = [tensor for tensor in held if tensor is not p and tensor is not q]
    assert computed, "the frames below the op hold none of its intermediates"
    for tensor in held:
        try:
            repr(tensor)
        except tx.PlaceholderError:
            pass
        else:
            raise AssertionError(f"a {tensor.shape} tensor the traceback holds was readable")
    torch_xla.sync()  # with the failed op's work pending, then real work
    assert (torch.ones(3, device="xla") * 2).cpu().sum().item() == 6.0
    print("survived", len(computed))


def test_the_tensors_a_failed_op_leaves_in_its_traceback_are_guarded(run_isolated):
    result = run_isolated(failed_op_scenario)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "survived" in result.stdout


def test_sync_warns_about_discarded_work():
    leftover = tx.placeholder((1,)) + 1  # so that the flush below always warns
    with pytest.warns(RuntimeWarning):  # flushes what earlier tests' tracebacks keep alive
        torch_xla.sync()
    del leftover
    p = tx.placeholder((2,))
    pending = p + 1
    with pytest.warns(RuntimeWarning, match="discarded 1 pending computation"):
        torch_xla.sync()
    with pytest.raises(tx.PlaceholderError, match="discarded when torch_xla synced"):
        pending.cpu()


def test_every_message_names_placeholders_by_the_core_description():
    p, q = tx.placeholder((2, 3)), tx.placeholder((3,), torch.float16)
    with pytest.raises(tx.PlaceholderError) as read:
        p.tolist()
    with pytest.raises(tx.PlaceholderError) as read_derived:
        (p.sum(0).half() * q).cpu()
    with pytest.raises(tx.PlaceholderError) as assign:
        tx._C.find_placeholder(tx.placeholder_id(p)).assign()
    pending = p[0] + 1
    with pytest.warns(RuntimeWarning) as discard:
        torch_xla.sync()
    with pytest.raises(tx.PlaceholderError) as read_discarded:
        pending.cpu()
    assert f"of {describe(p)} (via tolist)" in str(read.value)
    assert f"computed from {describe(p)}, {describe(q)}" in str(read_derived.value)
    assert f"cannot assign a value to {describe(p)}:" in str(assign.value)
    assert any(describe(p) in str(w.message) for w in discard)
    assert f"a float32[3] tensor computed from {describe(p)}" in str(read_discarded.value)
    # The discarded tensor is a placeholder now, registered like the others.
    assert tx.is_placeholder(pending)
    assert tx.placeholder_id(pending) in [entry.id for entry in tx.live_placeholders()]


SYNC_ENTRY_POINTS = ("_xla_step_marker", "_xla_sync_multi", "_xla_sync_live_tensors")

LAZY_SYNC_GUARD = f"""
import torch, torch_xla
originals = {{name: getattr(torch_xla._XLAC, name) for name in {SYNC_ENTRY_POINTS!r}}}
import torch_xla_ext as tx
from torch_xla_ext import layer_stack, metrics, placeholders, scan
from torch_xla_ext.patches import torch_xla as torch_xla_patches
assert torch_xla_patches.SYNC_ENTRY_POINTS == {SYNC_ENTRY_POINTS!r}

def untouched():
    return all(getattr(torch_xla._XLAC, name) is entry for name, entry in originals.items())

# Real work and syncs, but no placeholder: nothing is patched.
a = torch.ones(3, device="xla") * 2
torch_xla.sync()
assert a.cpu().tolist() == [2.0] * 3
assert untouched(), "importing torch_xla_ext patched torch_xla's sync entry points"
p = tx.placeholder((3,))
assert all(getattr(torch_xla._XLAC, name).__wrapped__ is entry for name, entry in originals.items())
print("lazy")
"""


def test_sync_entry_points_untouched_until_a_placeholder_exists(run_isolated):
    result = run_isolated(LAZY_SYNC_GUARD)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "lazy" in result.stdout


CONCURRENT_FIRST_PLACEHOLDERS = f"""
import threading
import torch, torch_xla
originals = {{name: getattr(torch_xla._XLAC, name) for name in {SYNC_ENTRY_POINTS!r}}}
import torch_xla_ext as tx

# Threads racing to make the first placeholders, each of which installs the
# guard (test/test_patches.py makes the race certain on the mechanism itself).
start = threading.Barrier(8)
made = []
def make():
    start.wait()
    made.append(tx.placeholder((2,)))
threads = [threading.Thread(target=make) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert len(made) == 8 and len({{tx.placeholder_id(p) for p in made}}) == 8
for name, entry in originals.items():
    guarded = getattr(torch_xla._XLAC, name)
    assert guarded.__wrapped__ is entry, f"{{name}} is wrapped more than once"
print("once")
"""


def test_concurrent_first_placeholders_install_the_guard_once(run_isolated):
    result = run_isolated(CONCURRENT_FIRST_PLACEHOLDERS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "once" in result.stdout
