"""The trace cache recognises the same function: fresh lambdas, closures,
partials and bound methods over the same objects share one trace, read the
tensors of the call at hand, and the cache keeps nothing alive."""
import dataclasses
import functools
import gc
import types
import weakref

import pytest
import torch
import torch_xla

import torch_xla_ext as tx
from reference import scan_loop
from tolerances import ACCUMULATED, TRAINING, close
from torch_xla_ext.scan.cache import CacheInfo, WeakIdentity
from torch_xla_ext.scan.traced import Traced

DEV = torch_xla.device()


def randn(*shape, grad=False):
    return torch.randn(*shape, device=DEV).requires_grad_(grad)


@pytest.fixture(autouse=True)
def empty_cache():
    tx.cache_clear()
    yield
    tx.cache_clear()


def traces_and_hits():
    info = tx.cache_info()
    return info.misses, info.hits


class RNN(torch.nn.Module):
    """The issue's pattern: forward calls scan with a lambda made afresh each call."""

    def __init__(self, width):
        super().__init__()
        self.cell = torch.nn.Linear(width, width)

    def forward(self, h, xs):
        return tx.scan(lambda c, x: (torch.tanh(self.cell(c) + x), c.sum()), h, xs)


class LoopRNN(RNN):
    def forward(self, h, xs):
        return scan_loop(lambda c, x: (torch.tanh(self.cell(c) + x), c.sum()), h, xs)


def test_fresh_lambda_per_call_over_the_same_module_traces_once():
    torch.manual_seed(0)
    model = RNN(4).to(DEV)
    reference = LoopRNN(4).to(DEV)
    reference.load_state_dict(model.state_dict())
    h, xs = randn(2, 4), randn(3, 2, 4)
    for _ in range(4):
        with torch.no_grad():
            carry, ys = model(h, xs)
            expected_carry, expected_ys = reference(h, xs)
        close(carry, expected_carry, ACCUMULATED)
        close(ys, expected_ys, ACCUMULATED)
    assert traces_and_hits() == (1, 3)


def test_the_issues_forward_pattern_over_training_steps():
    """Five optimizer steps: one trace, and each step's gradients (which read
    the weights the previous step updated) equal the for loop's."""
    torch.manual_seed(0)
    model, reference = RNN(4).to(DEV), LoopRNN(4).to(DEV)
    reference.load_state_dict(model.state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    h, xs = randn(2, 4, grad=True), randn(3, 2, 4)
    for _ in range(5):
        gradients = []
        for m, optimizer in zip((model, reference), optimizers):
            carry, ys = m(h, xs)
            (carry.pow(2).sum() + ys.sum()).backward()
            gradients.append([p.grad.cpu().clone() for p in (*m.parameters(), h)])
            optimizer.step()
            optimizer.zero_grad()
            h.grad = None
            torch_xla.sync()
        for got, expected in zip(*gradients):
            close(got, expected, TRAINING)
    assert traces_and_hits() == (1, 4)


def with_tensor_in_cell(w):
    return lambda c, x: (c @ w + x, None)


def with_tensor_in_list(w):
    weights = [w]
    return lambda c, x: (c @ weights[0] + x, None)


def with_tensor_in_dict(w):
    weights = {"w": w}
    return lambda c, x: (c @ weights["w"] + x, None)


def with_tensor_as_default(w):
    def step(c, x, w=w):
        return c @ w + x, None
    return step


def with_tensor_as_keyword_default(w):
    def step(c, x, *, w=w):
        return c @ w + x, None
    return step


def with_tensor_in_partial(w):
    return functools.partial(lambda w, c, x: (c @ w + x, None), w)


def with_tensor_in_partial_keyword(w):
    return functools.partial(lambda c, x, w: (c @ w + x, None), w=w)


@pytest.mark.parametrize("make_fn", [
    with_tensor_in_cell, with_tensor_in_list, with_tensor_in_dict, with_tensor_as_default,
    with_tensor_as_keyword_default, with_tensor_in_partial, with_tensor_in_partial_keyword])
def test_fresh_closure_over_a_new_tensor_hits_and_reads_it(make_fn):
    h, xs = randn(3), randn(2, 3)
    first, second = randn(3, 3), randn(3, 3)
    results = []
    for w in (first, second):
        fn = make_fn(w)
        results.append(tx.scan(fn, h, xs)[0])
        close(results[-1], scan_loop(fn, h, xs)[0], ACCUMULATED)
    assert traces_and_hits() == (1, 1)
    assert not torch.allclose(results[0].cpu(), results[1].cpu())


def test_new_tensor_of_another_aval_traces_again():
    h, xs = randn(3), randn(2, 3)
    tx.scan(with_tensor_in_cell(randn(3, 3)), h, xs)
    fn = with_tensor_in_cell(randn(3, 3, grad=True))
    close(tx.scan(fn, h, xs)[0], scan_loop(fn, h, xs)[0], ACCUMULATED)
    assert traces_and_hits() == (2, 0)


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def step(self, c, x):
        return self.lin(c) * 2 + x, None


def test_bound_methods_and_partials_made_afresh_hit():
    torch.manual_seed(0)
    module = Scaled().to(DEV)
    h, xs = randn(3), randn(2, 3)
    for _ in range(3):
        close(tx.scan(module.step, h, xs)[0], scan_loop(module.step, h, xs)[0], ACCUMULATED)
    assert traces_and_hits() == (1, 2)

    def step(scale, c, x, *, shift):
        return module.lin(c) * scale + shift + x, None

    for _ in range(3):
        fn = functools.partial(step, 0.5, shift=1.0)
        close(tx.scan(fn, h, xs)[0], scan_loop(fn, h, xs)[0], ACCUMULATED)
    assert traces_and_hits() == (2, 4)
    other = Scaled().to(DEV)  # another object bound: another trace, its own weights
    close(tx.scan(other.step, h, xs)[0], scan_loop(other.step, h, xs)[0], ACCUMULATED)
    assert traces_and_hits() == (3, 4)


def scaled_by(scale):
    return lambda c, x: (c * scale + x, None)


def test_what_changes_the_program_changes_the_key():
    h, xs = randn(3), randn(2, 3)
    for scale in (2.0, 3.0, 2.0):
        fn = scaled_by(scale)
        close(tx.scan(fn, h, xs)[0], scan_loop(fn, h, xs)[0], ACCUMULATED)
    assert traces_and_hits() == (2, 1)
    for scale in (True, 1, 1.0):  # equal in Python, but each traces its own program
        tx.scan(scaled_by(scale), h, xs)
    assert traces_and_hits() == (5, 1)

    def shifted(c, x, shift=1.0):
        return c + x + shift, None

    first = tx.scan(shifted, h, xs)[0]
    shifted.__defaults__ = (5.0,)
    second = tx.scan(shifted, h, xs)[0]
    close(second, scan_loop(shifted, h, xs)[0], ACCUMULATED)
    close(second - first, torch.full((3,), 8.0), ACCUMULATED)  # 2 steps, each 4.0 more
    assert traces_and_hits() == (7, 1)

    def keyword_shifted(c, x, *, shift=1.0):
        return c + x + shift, None

    tx.scan(keyword_shifted, h, xs)
    keyword_shifted.__kwdefaults__ = {"shift": -1.0}
    close(tx.scan(keyword_shifted, h, xs)[0], scan_loop(keyword_shifted, h, xs)[0], ACCUMULATED)
    assert traces_and_hits() == (9, 1)

    def factors(values):
        return lambda c, x: (c * values[0] + x * values[1], None)

    for values in ([1.0, 2.0], [1.0, 3.0], [1.0, 2.0]):
        fn = factors(values)
        close(tx.scan(fn, h, xs)[0], scan_loop(fn, h, xs)[0], ACCUMULATED)
    assert traces_and_hits() == (11, 2)


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenSettings:
    scale: float


class Settings:
    def __init__(self, scale):
        self.scale = scale


@pytest.mark.parametrize("settings_of", [types.SimpleNamespace, FrozenSettings],
                         ids=["SimpleNamespace", "slotted dataclass"])
def test_settings_that_cannot_be_referenced_weakly_count_by_their_attributes(settings_of):
    h, xs = randn(3), randn(2, 3)

    def scaled(settings):
        return lambda c, x: (c * settings.scale + x, None)

    for scale in (2.0, 2.0, 3.0):
        fn = scaled(settings_of(scale=scale))
        close(tx.scan(fn, h, xs)[0], scan_loop(fn, h, xs)[0], ACCUMULATED)
    assert traces_and_hits() == (2, 1)


def test_other_objects_count_by_identity():
    h, xs = randn(3), randn(2, 3)
    settings = Settings(2.0)
    for _ in range(2):
        fn = (lambda s: lambda c, x: (c * s.scale + x, None))(settings)
        close(tx.scan(fn, h, xs)[0], scan_loop(fn, h, xs)[0], ACCUMULATED)
    fn = (lambda s: lambda c, x: (c * s.scale + x, None))(Settings(3.0))
    close(tx.scan(fn, h, xs)[0], scan_loop(fn, h, xs)[0], ACCUMULATED)
    assert traces_and_hits() == (2, 1)


def test_nonlocal_rebinding_of_a_constant_traces_again():
    h, xs = randn(3), randn(2, 3)
    scale = 2.0

    def fn(c, x):
        return c * scale + x, None

    tx.scan(fn, h, xs)
    scale = 4.0
    close(tx.scan(fn, h, xs)[0], scan_loop(fn, h, xs)[0], ACCUMULATED)
    assert traces_and_hits() == (2, 0)


def test_train_and_eval_modes_trace_apart():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).to(DEV)
    h, xs = randn(2, 4), randn(3, 2, 4)

    def run():
        return tx.scan(lambda c, x: (model(c) + x, None), h, xs)[0]

    run()
    model.eval()
    with torch.no_grad():
        close(run(), scan_loop(lambda c, x: (model(c) + x, None), h, xs)[0], ACCUMULATED)
    assert traces_and_hits() == (2, 0)


def test_replaced_parameter_is_read_through_the_module():
    lin = torch.nn.Linear(3, 3).to(DEV)
    h, xs = randn(3), randn(2, 3)
    for _ in range(2):
        fn = lambda c, x: (lin(c), None)  # noqa: E731
        close(tx.scan(fn, h, xs)[0], scan_loop(fn, h, xs)[0], ACCUMULATED)
        lin.weight = torch.nn.Parameter(randn(3, 3))
    assert traces_and_hits() == (1, 1)


GLOBAL_WEIGHT = None


def test_capture_no_path_reaches_is_bound_to_the_tensor_itself():
    global GLOBAL_WEIGHT
    GLOBAL_WEIGHT = randn(3, 3)
    h, xs = randn(3), randn(2, 3)
    try:
        for _ in range(2):
            fn = lambda c, x: (c @ GLOBAL_WEIGHT + x, None)  # noqa: E731
            close(tx.scan(fn, h, xs)[0], scan_loop(fn, h, xs)[0], ACCUMULATED)
            with torch.no_grad():
                GLOBAL_WEIGHT.mul_(2)
        assert traces_and_hits() == (1, 1)
        GLOBAL_WEIGHT = randn(3, 3)  # a new global: the old binding is gone, so a new trace
        close(tx.scan(fn, h, xs)[0], scan_loop(fn, h, xs)[0], ACCUMULATED)
        assert traces_and_hits() == (2, 1)
    finally:
        GLOBAL_WEIGHT = None


def live_traces() -> int:
    gc.collect()
    return sum(type(o) is Traced for o in gc.get_objects())


def test_fresh_lambdas_over_fresh_modules_are_all_collected():
    h, xs = randn(2, 4), randn(3, 2, 4)
    torch_xla.sync()
    modules = []
    traces_before = live_traces()  # of other tests, if they keep any

    def call():
        # Initialized on the host: drawn on the device, each module's weights
        # would lengthen the device's random seed's graph, which every graph
        # drawing random numbers then compiles until the next sync.
        lin = torch.nn.Linear(4, 4).to(DEV)
        modules.append(weakref.ref(lin))
        with torch.no_grad():
            tx.scan(lambda c, x: (lin(c) + x, None), h, xs)

    for _ in range(1000):
        call()
    size = tx.cache_info().size
    gc.collect()
    assert all(ref() is None for ref in modules)
    assert size <= 1 and tx.cache_info().size == 0
    assert live_traces() <= traces_before


def test_dead_identity_never_matches():
    class Thing:
        pass

    thing = Thing()
    stored, other = WeakIdentity(thing), WeakIdentity(thing)
    assert stored == other and hash(stored) == hash(other)
    del thing
    assert stored != other and stored != stored


def test_is_fn_pure_false_traces_every_call_and_stores_nothing():
    calls = []

    def fn(c, x):
        calls.append(1)
        return c + x, None

    h, xs = randn(3), randn(2, 3)
    results = [tx.scan(fn, h, xs, is_fn_pure=False)[0] for _ in range(3)]
    assert len(calls) == 3
    assert tx.cache_info() == CacheInfo(0, 0, 0, tx.cache_info().maxsize)
    for result in results:
        close(result, scan_loop(fn, h, xs)[0], ACCUMULATED)


class Slotted:
    __slots__ = ("scale",)

    def __init__(self, scale):
        self.scale = scale


def test_an_unkeyable_closure_traces_every_call_with_a_warning():
    settings = Slotted(2.0)
    traces = []

    def fn(c, x):
        traces.append(1)
        return c * settings.scale + x, None

    h, xs = randn(3), randn(2, 3)
    with pytest.warns(UserWarning, match=r"fn<closure settings> is a Slotted.*traced at every call"):
        tx.scan(fn, h, xs)
    settings.scale = 3.0
    with pytest.warns(UserWarning):
        close(tx.scan(fn, h, xs)[0], scan_loop(fn, h, xs)[0], ACCUMULATED)
    assert len(traces) == 2 + 2 and tx.cache_info().size == 0


def test_same_function_object_filling_a_list_traces_once():
    """A list fn appends to changes between calls; the same fn object still
    hits (a fresh fn's lists are compared by contents: see `factors` above)."""
    seen = []

    def fn(c, x):
        seen.append(c.shape)
        return c + x, None

    for _ in range(3):
        tx.scan(fn, randn(3), randn(2, 3))
    assert len(seen) == 1 and traces_and_hits() == (1, 2)


def test_host_tensors_are_baked_in_so_count_by_identity():
    h, xs = randn(3), randn(2, 3)
    for scale in (torch.tensor(2.0), torch.tensor(3.0)):  # 0-d host tensors, as constants
        fn = scaled_by(scale)
        close(tx.scan(fn, h, xs)[0], scan_loop(fn, h, xs)[0], ACCUMULATED)
    assert traces_and_hits() == (2, 0)
