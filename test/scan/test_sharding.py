"""scan under SPMD: the loops keep their operands' shardings (a carry's, the
gradients of xs as xs); mark_sharding inside fn annotates the loop and gives
the for loop's results; the mark_sharding redirect is installed lazily, once,
and per thread, and the shardings registry stays bounded. Each scenario runs
in a fresh process with 4 CPU devices (SPMD must be chosen before any XLA
work)."""
import os
import threading

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch._subclasses.functional_tensor import FunctionalTensor

import torch_xla_ext as tx
from optimized_hlo import dump_flags, loop_states, step_module
from reference import scan_loop
from tolerances import ACCUMULATED, close
from torch_xla_ext.scan import sharding

SPMD_DEVICES = {"CPU_NUM_DEVICES": "4"}


class Spmd:
    """In a scenario's process: SPMD on its 4 devices, a Linear, and a step
    that shards its carry inside scan's fn."""

    def __init__(self):
        xr.use_spmd()
        self.mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), (4, 1),
                            ("data", "model"))
        self.dev = torch_xla.device()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8).to(self.dev)

    def make_fn(self, wait_for=None, waiting=None):
        def fn(carry, x):
            if wait_for is not None and isinstance(carry, FunctionalTensor):
                waiting.set()            # inside AOTAutograd's trace, redirect active
                assert wait_for.wait(120)
            xs.mark_sharding(carry, self.mesh, ("data", None))
            h = self.lin(carry) + x
            xs.mark_sharding(h, self.mesh, (None, "data"))
            h = torch.tanh(h)
            return h, h.sum(0)
        return fn

    def step(self, scanner, fn):
        init = torch.ones(8, 8, device=self.dev, requires_grad=True)
        carry, ys = scanner(fn, init, torch.ones(3, 8, 8, device=self.dev) * 0.1)
        (carry.sum() + ys.sum()).backward()
        weight_grad, self.lin.weight.grad = self.lin.weight.grad.cpu(), None
        return [carry.cpu(), ys.cpu(), init.grad.cpu(), weight_grad]

    def check_matches(self, got):
        close(got, self.step(scan_loop, self.make_fn()), ACCUMULATED)


def mark_sharding_in_fn_scenario():
    spmd = Spmd()
    carry, _ = tx.scan(spmd.make_fn(), torch.ones(8, 8, device=spmd.dev),
                       torch.ones(3, 8, 8, device=spmd.dev))
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([carry])
    assert "sharding={devices=[4,1]" in hlo, "no sharding annotation in the scan's HLO"
    spmd.check_matches(spmd.step(tx.scan, spmd.make_fn()))
    print("matched")


def test_mark_sharding_inside_fn_annotates_and_matches_the_loop(run_isolated):
    result = run_isolated(mark_sharding_in_fn_scenario, env=SPMD_DEVICES)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "matched" in result.stdout


def repeated_traces_scenario():
    spmd = Spmd()
    torch_xla_mark_sharding = torch_xla._XLAC._xla_mark_sharding
    spmd.step(scan_loop, spmd.make_fn())
    assert torch_xla._XLAC._xla_mark_sharding is torch_xla_mark_sharding, \
        "installed without a scan"
    sizes = []
    for _ in range(4):
        got = spmd.step(lambda f, i, x: tx.scan(f, i, x, is_fn_pure=False), spmd.make_fn())
        sizes.append(len(sharding._traced_shardings))
    spmd.check_matches(got)
    assert torch_xla._XLAC._xla_mark_sharding is sharding._redirected_mark_sharding
    assert sharding._mark_sharding_in_place is torch_xla_mark_sharding
    assert sizes == [2, 2, 2, 2], sizes
    assert sorted(sharding._traced_shardings) == ["{devices=[1,4]0,1,2,3}",
                                                  "{devices=[4,1]0,1,2,3}"]
    print("bounded")


def test_shardings_registry_does_not_grow_over_repeated_traces(run_isolated):
    result = run_isolated(repeated_traces_scenario, env=SPMD_DEVICES)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bounded" in result.stdout


def concurrent_traces_scenario():
    # Thread B pauses inside its AOTAutograd trace while the main thread runs a
    # whole scan (trace, partition, loops) with another fn: the main thread's end
    # of tracing must not take B's redirect away.
    spmd = Spmd()
    a_done, b_waiting = threading.Event(), threading.Event()
    results = {}

    def thread_b():
        try:
            results["b"] = spmd.step(tx.scan, spmd.make_fn(a_done, b_waiting))
        except BaseException as error:
            results["b"] = error

    b = threading.Thread(target=thread_b)
    b.start()
    assert b_waiting.wait(120)
    results["a"] = spmd.step(tx.scan, spmd.make_fn())
    a_done.set()
    b.join(240)
    assert not isinstance(results["b"], BaseException), repr(results["b"])
    spmd.check_matches(results["a"])
    spmd.check_matches(results["b"])
    print("both traced")


def test_concurrent_traces_keep_their_mark_sharding_redirect(run_isolated):
    result = run_isolated(concurrent_traces_scenario, env=SPMD_DEVICES)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "both traced" in result.stdout


def operand_shardings_scenario():
    """A carry split on its batch, per-layer weights split as FSDP splits them:
    the loops keep the carry batch-split, the weights' gradients come out
    split as the weights, and the results are the for loop's."""
    spmd = Spmd()
    mesh = xs.Mesh(np.arange(4), (4,), ("data",))
    sharded = []
    for shape, spec in (((8, 16), ("data", None)), ((3, 16, 16), (None, None, "data")),
                        ((3, 16), (None, "data"))):
        tensor = (torch.randn(shape) * 0.3).to(spmd.dev)
        xs.mark_sharding(tensor, mesh, spec)
        sharded.append(tensor.requires_grad_())
    hidden, weights, scales = sharded

    def step(carry, x):
        weight, scale = x
        carry = torch.tanh((carry * scale) @ weight.T) + carry
        return carry, torch.sigmoid(carry)

    results = {}
    for scanner in (tx.scan, scan_loop):
        carry, ys = scanner(step, hidden, (weights, scales))
        (carry.sum() + ys.sum()).backward()
        torch_xla.sync()
        grads = [t.grad for t in sharded]
        results[scanner] = [carry.cpu(), ys.cpu(), *(g.cpu() for g in grads)]
        if scanner is tx.scan:
            specs = [torch_xla._XLAC._get_xla_sharding_spec(t) for t in (weights, scales)]
            assert [torch_xla._XLAC._get_xla_sharding_spec(g) for g in grads[1:]] == specs
        for tensor in sharded:
            tensor.grad = None
    close(results[tx.scan], results[scan_loop], ACCUMULATED)
    states = loop_states(step_module(os.environ["DUMP"], looped=True).optimized_hlo)
    assert len(states) == 2, states
    for state in states:
        # Each device's part of the batch, whole hidden vectors; no weight gradient whole.
        assert "f32[2,16]" in state and "f32[8,4]" not in state, state
        assert "f32[3,16,16]" not in state and "f32[3,16]" not in state, state
    print("kept")


def test_the_loops_keep_their_operands_shardings(run_isolated, tmp_path):
    flags = dump_flags(tmp_path)
    result = run_isolated(operand_shardings_scenario,
                          env={**SPMD_DEVICES, "XLA_FLAGS": flags, "DUMP": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kept" in result.stdout


def spec_shardings_scenario():
    """Every sharding of a 2x2 mesh read back from its spec, whole and per
    slice along the leading dimension; data parallelism told apart."""
    Spmd()
    mesh = xs.Mesh(np.arange(4), (2, 2), ("a", "b"))
    spec_of = torch_xla._XLAC._get_xla_sharding_spec

    def marked(shape, sharding):
        tensor = torch.zeros(shape, device=torch_xla.device()) + 1
        if isinstance(sharding, tuple):
            xs.mark_sharding(tensor, mesh, sharding)
        else:
            torch_xla._XLAC._xla_mark_sharding(tensor, sharding)
        return spec_of(tensor)

    for spec in [("a", "b", None), (None, "a", "b"), ("b", None, None), (None, None, None),
                 (("a", "b"), None, None), (None, ("b", "a"), None), ("b", "a", None)]:
        whole = marked((4, 4, 4), spec)
        assert marked((4, 4, 4), sharding.spec_sharding(whole)) == whole, (spec, whole)
        slice_spec = marked((4, 4), sharding.spec_sharding(whole, leading_dropped=True))
        assert slice_spec == marked((4, 4), spec[1:]), (spec, whole, slice_spec)
    assert sharding.spec_sharding("") is None
    assert sharding.spec_sharding("{maximal device=1}") is None
    assert sharding.data_parallel_devices(marked((4, 4), (("b", "a"), None))) == (0, 2, 1, 3)
    assert sharding.data_parallel_devices(marked((4, 4), ("a", None))) is None  # copies on 'b'
    assert sharding.data_parallel_devices(marked((4, 4), (None, ("a", "b")))) is None
    assert marked((4, 8, 2), sharding.split_along((0, 2, 1, 3), 3, 1)) == marked(
        (4, 8, 2), (None, ("b", "a"), None))
    print("read back")


def test_shardings_are_read_back_from_their_specs(run_isolated):
    result = run_isolated(spec_shardings_scenario, env=SPMD_DEVICES)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "read back" in result.stdout


def nested_scenario():
    spmd = Spmd()
    weights = (torch.randn(3, 2, 8, 8) * 0.3).to(spmd.dev).requires_grad_()
    init = torch.randn(8, 8).to(spmd.dev)
    xs.mark_sharding(init, spmd.mesh, ("data", None))

    def layer(h, w):
        return torch.tanh(h @ w) + h, h.sum()

    def outer(scanner):
        return lambda c, group: scanner(layer, c, group)

    def step(scanner):
        carry, ys = scanner(outer(scanner), init, weights)
        (carry.sum() + ys.sum()).backward()
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([weights.grad])
        grads, weights.grad = weights.grad.cpu(), None
        return [carry.cpu(), ys.cpu(), grads], hlo

    got, hlo = step(tx.scan)
    # Forward and backward, outer and inner: the training loops nest too.
    assert hlo.count(" while(") == 4, hlo.count(" while(")
    close(got, step(scan_loop)[0], ACCUMULATED)
    print("nested")


def test_a_nested_scan_under_spmd_trains_as_loops_in_loops_with_the_loops_results(run_isolated):
    result = run_isolated(nested_scenario, env=SPMD_DEVICES)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "nested" in result.stdout
