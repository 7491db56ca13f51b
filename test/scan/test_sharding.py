"""scan under SPMD: mark_sharding inside fn annotates the loop and gives the
for loop's results; the mark_sharding redirect is installed lazily, once, and
per thread, and the shardings registry stays bounded. Each scenario runs in a
fresh process with 4 CPU devices (SPMD must be chosen before any XLA work)."""
import threading

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch._subclasses.functional_tensor import FunctionalTensor

import torch_xla_ext as tx
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
