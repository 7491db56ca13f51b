"""scan's `unroll`: k steps per iteration of the While loops, forward and
backward, with the same results as one step per iteration."""
import re

import pytest
import torch
import torch_xla

import torch_xla_ext as tx
from reference import scan_loop

DEV = torch_xla.device()
LENGTH = 5  # a multiple of none of the unrolls below: steps are left over


def step_with_dropout(weight):
    def fn(carry, x):
        hidden = torch.nn.functional.dropout(torch.tanh(carry @ weight + x), p=0.5)
        return hidden, (hidden * x).sum(-1)
    return fn


def run_and_grads(fn, leaves, unroll, reverse, seed):
    """The carry, ys and gradients of all `leaves` of one scan call."""
    init, xs, weight = leaves
    torch.manual_seed(seed)  # the loop's per-step dropout seeds
    if unroll is None:
        carry, ys = scan_loop(fn, init, xs, reverse=reverse)
    else:
        carry, ys = tx.scan(fn, init, xs, unroll=unroll, reverse=reverse)
    (carry.square().sum() + ys.sum()).backward()
    results = [carry, ys, *(leaf.grad for leaf in leaves)]
    torch_xla.sync()
    for leaf in leaves:
        leaf.grad = None
    return [t.detach().cpu() for t in results]


@pytest.mark.parametrize("unroll, reverse", [(2, False), (3, True), (True, False)])
def test_unrolled_results_and_gradients_are_those_of_one_step_an_iteration(unroll, reverse):
    torch.manual_seed(0)
    init = torch.randn(2, 4, device=DEV, requires_grad=True)
    xs = torch.randn(LENGTH, 2, 4, device=DEV, requires_grad=True)
    weight = (torch.randn(4, 4) / 2).to(DEV).requires_grad_()
    fn = step_with_dropout(weight)
    one_step = run_and_grads(fn, (init, xs, weight), 1, reverse, seed=7)
    unrolled = run_and_grads(fn, (init, xs, weight), unroll, reverse, seed=7)
    # The same per-step dropout masks: each step reads its seed by its index.
    for got, expected in zip(unrolled, one_step):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # Both are the for loop's (without dropout, whose masks the loop draws otherwise).
    deterministic = lambda c, x: (torch.tanh(c @ weight + x), (c * x).sum(-1))
    loop = run_and_grads(deterministic, (init, xs, weight), None, reverse, seed=0)
    for got, expected in zip(run_and_grads(deterministic, (init, xs, weight), unroll, reverse,
                                           seed=0), loop):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_each_unroll_builds_loops_of_k_steps_from_one_trace():
    weight = torch.randn(4, 4, device=DEV, requires_grad=True)
    fn = lambda c, x: (torch.tanh(c @ weight + x), c.sum())
    init, xs = torch.zeros(2, 4, device=DEV), torch.zeros(LENGTH, 2, 4, device=DEV)
    tx.cache_clear()
    for unroll, calls in ((1, 1), (3, 5), (True, 5)):
        lowered = tx.lower(fn, init, xs, unroll=unroll)
        for hlo in (lowered.forward_hlo, lowered.backward_hlo):
            # k calls of the step in the loop's body, and the 5 % k steps left over after it.
            assert len(re.findall(r" call\(", hlo)) == calls, (unroll, hlo)
            assert len(re.findall(r" while\(", hlo)) == 1
    # The trace is shared; the loops are built for each unroll.
    assert tx.cache_info()[:3] == (2, 1, 1)


@pytest.mark.parametrize("unroll, error, message", [
    (0, ValueError, "got 0;"),
    (-2, ValueError, "got -2;"),
    (1.5, TypeError, "got float 1.5"),
    ("2", TypeError, "got str '2'"),
    (None, TypeError, "got NoneType None"),
])
def test_bad_unrolls_are_refused_naming_the_value(unroll, error, message):
    xs = torch.zeros(3, 2, device=DEV)
    with pytest.raises(error, match=re.escape(message)):
        tx.scan(lambda c, x: (c + x, None), xs[0], xs, unroll=unroll)
    with pytest.raises(error, match="^lower: unroll"):
        tx.lower(lambda c, x: (c + x, None), xs[0], xs, unroll=unroll)
