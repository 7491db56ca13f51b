import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.utils._pytree import tree_flatten, tree_map

import torch_xla_ext as tx
from reference import scan_loop
from tolerances import ACCUMULATED, BF16_SAME_OPS, DTYPE_DEFAULT, SAME_OPS, close

DEV = torch_xla.device()


def grads_of(tensors):
    out = [t.grad.detach().cpu().clone() if t.grad is not None else None for t in tensors]
    for t in tensors:
        t.grad = None
    return out


def check_parity(fn, init, xs, params=(), reverse=False, tolerance=SAME_OPS):
    leaves = [t for t in tree_flatten((init, xs))[0] + list(params) if t.requires_grad]
    got = tx.scan(fn, init, xs, reverse=reverse)
    expected = scan_loop(fn, init, xs, reverse=reverse)
    close(got, expected, tolerance)
    if leaves:
        def total(result):
            return sum(t.float().sum() for t in tree_flatten(result)[0]
                       if t is not None and t.dtype.is_floating_point)
        total(got).backward()
        scan_grads = grads_of(leaves)
        total(expected).backward()
        loop_grads = grads_of(leaves)
        close(scan_grads, loop_grads, ACCUMULATED, "gradients")


def randn(*shape, grad=False, dtype=torch.float32):
    return torch.randn(*shape, device=DEV, dtype=dtype).requires_grad_(grad)


def test_cumulative_sum():
    check_parity(lambda c, x: (c + x, c), randn(3, grad=True), randn(5, 3, grad=True))


def test_dict_and_tuple_carry():
    def fn(carry, x):
        a, (b, n) = carry["a"], carry["bn"]
        return {"a": a * x["u"], "bn": (b + a.sum(), n + 1)}, (a, {"v": b * 2})
    init = {"a": randn(2, grad=True), "bn": (randn(3, grad=True), torch.zeros((), dtype=torch.int32, device=DEV))}
    check_parity(fn, init, {"u": randn(4, 2, grad=True)})


def test_rnn_cell_with_captured_weights():
    torch.manual_seed(0)
    cell = torch.nn.RNNCell(4, 6).to(DEV)
    check_parity(lambda h, x: (cell(x, h), h.tanh()), randn(1, 6, grad=True), randn(5, 1, 4, grad=True),
                 params=list(cell.parameters()))


def test_block_with_captured_weights_reverse():
    torch.manual_seed(1)
    block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)).to(DEV)
    check_parity(lambda c, x: (block(c) + x, None), randn(2, 4, grad=True), randn(3, 2, 4),
                 params=list(block.parameters()), reverse=True)


def test_min_cut_partition_gives_the_same_gradients():
    from functorch.compile import min_cut_rematerialization_partition
    torch.manual_seed(2)
    block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).to(DEV)
    init, xs = randn(2, 4, grad=True), randn(3, 2, 4, grad=True)
    fn = lambda c, x: (block(c).sin() + x, c.cos())
    params = [init, xs, *block.parameters()]
    carry, ys = tx.scan(fn, init, xs, partition_fn=min_cut_rematerialization_partition)
    (carry.sum() + ys.sum()).backward()
    min_cut = grads_of(params)
    carry, ys = scan_loop(fn, init, xs)
    (carry.sum() + ys.sum()).backward()
    close(min_cut, grads_of(params), ACCUMULATED)


def test_ys_with_none_and_passthrough():
    xs = randn(3, 2, grad=True)
    carry, ys = tx.scan(lambda c, x: (c * x, (None, x, c)), randn(2), xs)
    assert ys[0] is None and ys[1] is xs  # an x returned as y is not copied
    init = randn(2)
    close(tx.scan(lambda c, x: (c * x, (None, x, c)), init, xs),
          scan_loop(lambda c, x: (c * x, (None, x, c)), init, xs), SAME_OPS)


def test_read_only_carry_keeps_init():
    init = (randn(2, grad=True), randn(2, grad=True))
    (fixed, moving), _ = tx.scan(lambda c, x: ((c[0], c[1] + c[0] * x), None), init, randn(3, 2))
    assert fixed is init[0]
    check_parity(lambda c, x: ((c[0], c[1] + c[0] * x), None), init, randn(3, 2, grad=True))


def test_bfloat16_and_int32():
    check_parity(lambda c, x: (c + x, c * 2), randn(3, dtype=torch.bfloat16),
                 randn(4, 3, dtype=torch.bfloat16), tolerance=BF16_SAME_OPS)
    ints = torch.arange(12, dtype=torch.int32, device=DEV).reshape(4, 3)
    check_parity(lambda c, x: (c * 2 + x, c), torch.ones(3, dtype=torch.int32, device=DEV), ints)


def test_zero_length_returns_init_and_empty_ys():
    init = randn(3)
    carry, ys = tx.scan(lambda c, x: (c + x, {"y": c * 2}), init, randn(0, 3))
    assert carry is init and ys["y"].shape == (0, 3)


def test_dropout_differs_per_step_and_repeats_under_manual_seed():
    def fn(c, x):
        return c, torch.nn.functional.dropout(x, 0.5)
    xs = torch.ones(4, 64, device=DEV)
    torch.manual_seed(7)
    first = tx.scan(fn, randn(1), xs)[1].cpu()
    torch.manual_seed(7)
    again = tx.scan(fn, randn(1), xs)[1].cpu()
    assert torch.equal(first, again)
    masks = [tuple(row.tolist()) for row in first]
    assert len(set(masks)) == 4


@pytest.mark.parametrize("body", ["dropout", "reads an int64 scalar"])
def test_a_scan_leaves_the_callers_xla_random_numbers_as_they_were(body):
    # Sampling after a scanned forward must draw what it would draw without the
    # scan: tracing and the seed probes draw from the XLA RNG, while the loop's
    # dropout seeds come from torch's generator.
    offset = torch.tensor(2, device=DEV)

    def fn(c, x):
        y = torch.nn.functional.dropout(x, 0.5) if body == "dropout" else x * offset
        return c + y, y
    init, xs = randn(4, grad=True), randn(3, 4, grad=True)
    xm.set_rng_state(11, DEV)
    expected = torch.rand(8, device=DEV).cpu()
    for _ in range(2):  # traced, then from the cache
        xm.set_rng_state(11, DEV)
        carry, _ = tx.scan(fn, init, xs)
        carry.sum().backward()
        close(torch.rand(8, device=DEV).cpu(), expected, DTYPE_DEFAULT)


@pytest.mark.parametrize("p", [0.5, 0.1])
def test_dropout_gradients_follow_each_steps_mask(p):
    # p = 0.1 tells 1 / (1 - p) from 1 / p, which torch_xla's own native_dropout scales by.
    weight = torch.full((16,), 3.0, device=DEV, requires_grad=True)
    xs = torch.ones(8, 16, device=DEV)
    _, ys = tx.scan(lambda c, x: (c, torch.nn.functional.dropout(x * weight, p)), randn(1), xs)
    ys.sum().backward()
    kept = (ys.detach().cpu() != 0).float()  # y = weight * x / (1 - p) where kept, else 0
    assert 0 < kept.sum() < kept.numel()
    close(ys.detach().cpu(), kept * 3.0 / (1 - p), DTYPE_DEFAULT)
    close(weight.grad.cpu(), kept.sum(0) / (1 - p), DTYPE_DEFAULT)


def test_a_mask_drawn_from_the_seed_alone_is_kept_for_the_backward():
    # dropout(ones) reads nothing but the RNG seed: computed again in the
    # backward step, it would be drawn again and differ from the forward's.
    weight = torch.full((16,), 3.0, device=DEV, requires_grad=True)
    xs = torch.ones(5, 16, device=DEV)
    _, ys = tx.scan(lambda c, x: (c, torch.nn.functional.dropout(torch.ones_like(x), 0.5)
                                  * weight), randn(1), xs)
    ys.sum().backward()
    kept = (ys.detach().cpu() != 0).float()
    assert 0 < kept.sum() < kept.numel()
    close(weight.grad.cpu(), 2 * kept.sum(0), DTYPE_DEFAULT)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(length=st.integers(1, 6), widths=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       as_dict=st.booleans(), dtype=st.sampled_from([torch.float32, torch.int32]))
def test_matches_for_loop_on_random_pytrees(length, widths, as_dict, dtype):
    gen = torch.Generator().manual_seed(length * 31 + sum(widths))
    make = lambda *s: (torch.randn(*s, generator=gen) * 4).to(dtype).to(DEV)
    init = [make(w) for w in widths]
    xs = [make(length, w) for w in widths]
    if as_dict:
        init, xs = {f"k{i}": v for i, v in enumerate(init)}, {f"k{i}": v for i, v in enumerate(xs)}

    def fn(carry, x):
        new = tree_map(lambda c, v: c * 2 - v, carry, x)
        return new, tree_map(lambda c: c + 1, carry)

    close(tx.scan(fn, init, xs), scan_loop(fn, init, xs), SAME_OPS)


def test_traces_once_per_avals():
    calls = []

    def fn(c, x):
        calls.append(1)
        return c + x, c

    tx.cache_clear()
    for _ in range(5):
        tx.scan(fn, randn(3), randn(4, 3))
    assert len(calls) == 1
    tx.scan(fn, randn(5), randn(4, 5))
    assert len(calls) == 2
    info = tx.cache_info()
    assert (info.hits, info.misses, info.size) == (4, 2, 2)
    tx.scan(fn, randn(3), randn(4, 3), is_fn_pure=False)
    assert len(calls) == 3


def test_fresh_captures_after_in_place_update():
    lin = torch.nn.Linear(3, 3).to(DEV)
    fn = lambda c, x: (lin(c), None)
    init, xs = randn(3), randn(2, 3)
    before = tx.scan(fn, init, xs)[0].cpu()
    with torch.no_grad():
        lin.weight.mul_(2)
        lin.bias.add_(1)
    after = tx.scan(fn, init, xs)[0].cpu()
    close(after, scan_loop(fn, init, xs)[0].cpu(), DTYPE_DEFAULT)
    assert not torch.allclose(before, after)


def transfers():
    data = met.metric_data("TransferToDeviceTime")
    return data[0] if data else 0


def test_no_transfers_beyond_the_for_loop():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).to(DEV)
    init, xs = randn(8, grad=True), randn(4, 8, grad=True)
    torch_xla.sync()
    fn = lambda c, x: (torch.tanh(lin(c) + x), c.sum())

    def measure(run):
        met.clear_all()
        for _ in range(2):  # first call and cached call
            carry, ys = run(fn, init, xs)
            (carry.sum() + ys.sum()).backward()
            torch_xla.sync()
        return transfers()

    loop = measure(scan_loop)
    scanned = measure(tx.scan)
    assert scanned <= loop, f"scan made {scanned} transfers, the for loop {loop}"


def test_carries_written_back_in_place_keep_their_own_buffers():
    # A step writing two carries of one size in place (a stacked key/value
    # cache): torch_xla donates their buffers, and XLA gives each donated
    # buffer to an output of its size, in the order the graph numbers its
    # inputs. Each tensor must get its own buffer back, or XLA copies both
    # into the loop and back out.
    device = torch_xla.device()
    keys, values = torch.zeros(4, 8, 8, device=device), torch.zeros(4, 8, 8, device=device)
    torch_xla.sync()

    def step(carry, i):
        keys, values = carry
        row, at = torch.ones(1, 8, 8, device=device), (i.reshape(1),)
        return (keys.index_put(at, row), values.index_put(at, 2 * row)), None

    def buffers():
        xm.wait_device_ops()
        return [torch_xla._XLAC._unsafe_buffer_pointer(t) for t in (keys, values)]

    before = buffers()
    for _ in range(2):
        with torch.no_grad():
            (new_keys, new_values), _ = tx.scan(step, (keys, values),
                                                torch.arange(4, device=device))
            keys.copy_(new_keys)
            values.copy_(new_values)
        torch_xla.sync()
        assert buffers() == before
    assert keys.sum().item() == 4 * 64 and values.sum().item() == 2 * 4 * 64


def test_training_steps_compile_once():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).to(DEV)
    optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
    init, xs = randn(2, 8), randn(3, 2, 8)
    fn = lambda c, x: (block(c) + x, None)
    torch_xla.sync()
    compiles = []
    for _ in range(6):
        met.clear_all() if not compiles else None
        carry, _ = tx.scan(fn, init, xs)
        carry.pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        compiles.append(met.metric_data("CompileTime")[0])
    assert compiles[1:] == [compiles[0]] * 5, compiles


@pytest.mark.parametrize("call, error, match", [
    (lambda: tx.scan(lambda c, x: (c, x), randn(2), {"a": randn(3, 2), "b": randn(4, 2)}),
     ValueError, r"xs\['a'\] has 3 but xs\['b'\] has 4"),
    (lambda: tx.scan(lambda c, x: (c, x), [randn(2), 3.0], randn(3, 2)),
     TypeError, r"init\[1\] must be a tensor, got float"),
    (lambda: tx.scan(lambda c, x: (c, x), randn(2), torch.ones(3, 2)),
     ValueError, r"xs is on cpu, not an XLA device"),
    (lambda: tx.scan("fn", randn(2), randn(3, 2)), TypeError, "fn must be callable"),
    (lambda: tx.scan(lambda c, x: ({"h": c["h"].sum()}, x), {"h": randn(2)}, randn(3, 2)),
     TypeError, r"carry leaf carry\['h'\]: init has float32\[2\] but fn returned float32\[\]"),
    (lambda: tx.scan(lambda c, x: (c.int(), x), randn(2), randn(3, 2)),
     TypeError, r"init has float32\[2\] but fn returned int32\[2\]"),
    (lambda: tx.scan(lambda c, x: (c * x.sum().item(), x), randn(2), randn(3, 2)),
     tx.PlaceholderError, r"via item\) while scan's fn .* a scanned function cannot read data"),
    (lambda: tx.scan(lambda c, x: (c + x.cpu().to(DEV), x), randn(2), randn(3, 2)),
     tx.PlaceholderError, r"cannot read the value"),
    (lambda: tx.scan(lambda c, x: (c + x, torch_xla.sync()), randn(2), randn(3, 2)),
     tx.PlaceholderError, r"cannot sync while scan's fn"),
])
def test_bad_input_names_the_culprit_and_the_process_goes_on(call, error, match):
    with pytest.raises(error, match=match):
        call()
    carry, ys = tx.scan(lambda c, x: (c + x, c), torch.zeros(2, device=DEV), torch.ones(3, 2, device=DEV))
    assert carry.cpu().tolist() == [3.0, 3.0]


def in_place_ys_scenario(unroll):
    """A training step whose ys are reshaped copies of the carry, its HLO dumped."""
    dev = torch_xla.device()
    lin = torch.nn.Linear(16, 16).to(dev)
    init = torch.zeros(4, 16, device=dev, requires_grad=True)
    xs = torch.ones(7, 4, 16, device=dev, requires_grad=True)
    carry, ys = tx.scan(lambda c, x: (torch.tanh(lin(c) + x), (c * 2).reshape(64)), init, xs,
                        unroll=unroll)
    (carry.sum() + ys.sum()).backward()
    torch_xla.sync()


# With unroll 3, each body writes 3 slices, and 1 step is left after the loop.
@pytest.mark.parametrize("unroll", [1, 3])
def test_while_bodies_copy_no_stacked_buffer(run_isolated, tmp_path, unroll):
    import re
    result = run_isolated(in_place_ys_scenario, args=(unroll,), env={
        "XLA_FLAGS": f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text"})
    assert result.returncode == 0, result.stderr[-2000:]
    optimized = [p for p in tmp_path.iterdir() if p.name.endswith("after_optimizations.txt")]
    hlo = "\n".join(p.read_text() for p in optimized)
    bodies = set(re.findall(r"body=%([\w.\-]+)", hlo))
    assert len(bodies) == 2  # the forward and the backward loop
    for body in bodies:
        start = hlo.index(f"%{body} ")
        text = hlo[start:hlo.index("\n}\n", start)]
        stacked_copies = re.findall(r"= \w+\[7,[\d,]*\]\S* copy\(", text)
        assert not stacked_copies, f"{body} copies a stacked buffer each step: {stacked_copies}"


def test_same_results_as_torch_xla_scan():
    from torch_xla.experimental.scan import scan as torch_xla_scan

    def fn(carry, x):
        return carry * 0.5 + x.sin(), {"y": carry.cos(), "z": None}

    init, xs = randn(3, grad=True), randn(4, 3, grad=True)
    ours = tx.scan(fn, init, xs)
    theirs = torch_xla_scan(fn, init, xs)
    close(ours, theirs, SAME_OPS)


def test_concurrent_calls_from_threads_share_one_trace():
    from concurrent.futures import ThreadPoolExecutor
    calls = []

    def fn(c, x):
        calls.append(1)
        return c + x, c

    init, xs = torch.zeros(2, device=DEV), torch.ones(3, 2, device=DEV)
    tx.scan(fn, init, xs)  # the trace; the threads then hit the cache
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: tx.scan(fn, init, xs)[0].cpu().tolist(), range(8)))
    assert results == [[3.0, 3.0]] * 8 and len(calls) == 1


def test_cache_is_bounded_least_recently_used_first(monkeypatch):
    import importlib
    monkeypatch.setattr(importlib.import_module("torch_xla_ext.scan.cache").CACHE, "maxsize", 2)
    traced_widths = []

    def fn(c, x):
        traced_widths.append(c.shape[0])
        return c + x, None

    def call(width):
        tx.scan(fn, torch.zeros(width, device=DEV), torch.ones(2, width, device=DEV))

    tx.cache_clear()
    for width in (1, 2, 1, 3):  # 3 evicts 2, the least recently used
        call(width)
    assert tx.cache_info().size == 2 and tx.cache_info().maxsize == 2
    call(1)
    call(2)
    assert traced_widths == [1, 2, 3, 2]


def scan_of_placeholders_scenario():
    """A scan of placeholders stages its HLO; reading its results raises."""
    import warnings
    warnings.simplefilter("ignore")
    lin = torch.nn.Linear(4, 4).to(torch_xla.device())
    weight = tx.placeholder((4, 4))
    carry, ys = tx.scan(lambda c, x: (lin(c) @ weight + x, c.sum()), tx.placeholder((2, 4)),
                        tx.placeholder((5, 2, 4)))
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([carry, ys])
    assert "while" in hlo, hlo[:500]
    for result in (carry, ys):
        try:
            result.cpu()
        except tx.PlaceholderError:
            pass
        else:
            raise AssertionError("a scan of placeholders was readable")
    good = torch.ones(2, device=torch_xla.device()) * 3
    torch_xla.sync()
    assert good.cpu().tolist() == [3.0, 3.0]
    print("survived")


def test_scanning_placeholders_stages_hlo_and_never_crashes(run_isolated):
    result = run_isolated(scan_of_placeholders_scenario)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "survived" in result.stdout
