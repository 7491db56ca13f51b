"""Nested scans (scan/nested.py, scan/inline.py) against nested Python for loops."""
import copy
import functools
import re

import pytest
import torch
import torch_xla
from torch import nn
from torch.utils._pytree import tree_flatten

import torch_xla_ext as tx
from torch_xla_ext.diagnostics import NestedScanWarning
from torch_xla_ext.layer_stack import LayerStack
from reference import scan_loop
from test_scan import DEV, randn
from tolerances import THROUGH_LAYERS, close


def assert_close(actual, expected):
    torch_xla.sync()  # one execution for all, not one per tensor read
    close(actual, expected, THROUGH_LAYERS)


def grads(output, tensors):
    total = sum(t.sum() for t in tree_flatten(output)[0] if t is not None)
    return torch.autograd.grad(total, tensors)


def outer_step(inner_scan, weight, inner_reverse, carry, x):
    """One outer step: an inner scan over the rows of `x` (a [chunks, 3] slice)."""
    def inner_step(c, row):
        c = torch.tanh(c * weight + row)
        return c, {"sum": c.sum(), "none": None}

    c, ys = inner_scan(inner_step, carry, x, reverse=inner_reverse)
    return c * 0.5, (ys, None)


@pytest.mark.parametrize("outer_reverse,inner_reverse", [(False, True), (True, False)])
def test_scan_in_scan_matches_nested_loops(outer_reverse, inner_reverse):
    torch.manual_seed(0)
    weight, init, xs = randn(3, grad=True), randn(3, grad=True), randn(2, 4, 3, grad=True)
    got = tx.scan(functools.partial(outer_step, tx.scan, weight, inner_reverse), init, xs,
                  reverse=outer_reverse)
    expected = scan_loop(functools.partial(outer_step, scan_loop, weight, inner_reverse), init,
                         xs, reverse=outer_reverse)
    assert_close(got, expected)
    assert got[1][0]["sum"].shape == (2, 4) and got[1][0]["none"] is None
    assert_close(grads(got, [init, xs, weight]), grads(expected, [init, xs, weight]))


def test_outer_and_inner_fn_are_each_traced_once_and_cached():
    tx.cache_clear()
    runs = {"outer": 0, "inner": 0}
    weight = randn(3, grad=True)

    def inner_step(c, row):
        runs["inner"] += 1
        return c * weight + row, c

    def outer(c, x):
        runs["outer"] += 1
        return tx.scan(inner_step, c, x)

    init, xs = randn(3, grad=True), randn(2, 4, 3, grad=True)
    first = tx.scan(outer, init, xs)
    first_grads = grads(first, [init, xs, weight])
    # The outer fn runs on placeholders, then in AOTAutograd's passes; the
    # inner fn as often, its trace and training plan made once: never per step.
    assert runs["outer"] >= 2 and runs["inner"] == runs["outer"]
    traced_runs = dict(runs)
    second = tx.scan(outer, init, xs)
    second_grads = grads(second, [init, xs, weight])
    assert runs == traced_runs
    info = tx.cache_info()
    assert (info.misses, info.size) == (2, 2)  # the inner scan has its own entry
    assert_close((second, second_grads), (first, first_grads))
    expected = scan_loop(lambda c, x: scan_loop(inner_step, c, x), init, xs)
    assert_close((first, first_grads), (expected, grads(expected, [init, xs, weight])))


def _inner_layers_step(inner_scan_kwargs, carry, weights):
    """One outer step: an inner scan over `weights` ([inner length, 8, 8])."""
    def layer(h, w):
        return torch.tanh(h @ w) + h, h.sum()
    return tx.scan(layer, carry, weights, **inner_scan_kwargs)


def _instructions(hlo: str) -> list[str]:
    """The opcodes of HLO text's instructions (their shapes hold the lengths)."""
    return [re.search(r"\s([a-z][a-z0-9-]*)\(", line.split(" = ", 1)[1]).group(1)
            for line in hlo.splitlines() if " = " in line and not line.startswith("HloModule")]


def test_inner_scan_is_a_while_loop_of_its_own_whatever_its_length():
    lowered = {}
    for length in (2, 8):
        fn = functools.partial(_inner_layers_step, {})
        # The carry needs no grad, though the outer step's differentiation gives it one.
        lowered[length] = tx.lower(fn, randn(4, 8), randn(3, length, 8, 8, grad=True))
    for hlo in (lowered[2].forward_hlo, lowered[2].backward_hlo):
        assert _instructions(hlo).count("while") == 2  # the outer loop, and the inner in its step
    # Unrolled, the outer step would hold every inner step: here it is the same program.
    assert _instructions(lowered[2].forward_hlo) == _instructions(lowered[8].forward_hlo)
    assert _instructions(lowered[2].backward_hlo) == _instructions(lowered[8].backward_hlo)


def test_inner_fn_closing_over_what_the_outer_step_computes_is_a_loop_in_both_loops():
    def outer(c, x):
        scale = torch.sigmoid(x.sum())  # the outer step's own value, captured by the inner fn
        return tx.scan(lambda h, w: (torch.tanh(h @ w) * scale + h, None), c, x)

    init, xs = randn(4, 8, grad=True), randn(3, 2, 8, 8, grad=True)
    lowered = tx.lower(outer, init, xs)
    # AOTAutograd's differentiation calls the inner scan on fake tensors of
    # other classes than the outer trace's: it finds the same inner trace.
    assert _instructions(lowered.backward_hlo).count("while") == 2
    got = tx.scan(outer, init, xs)
    expected = scan_loop(lambda c, x: scan_loop(
        lambda h, w: (torch.tanh(h @ w) * torch.sigmoid(x.sum()) + h, None), c, x), init, xs)
    assert_close((got[0], grads(got, [init, xs])), (expected[0], grads(expected, [init, xs])))


def test_inner_scan_keeps_its_own_partition_fn_unroll_and_reverse():
    torch.manual_seed(0)
    init, xs = randn(4, 8, grad=True), randn(3, 4, 8, 8, grad=True) * 0.3
    xs = xs.detach().requires_grad_()
    expected = scan_loop(lambda c, w: scan_loop(
        lambda h, wi: (torch.tanh(h @ wi) + h, h.sum()), c, w, reverse=True), init, xs)
    expected_grads = grads(expected, [init, xs])
    hlo = {}
    for name, kwargs in {"default": {}, "save_nothing": {"partition_fn": "save_nothing"},
                         "unroll": {"unroll": 2}}.items():
        fn = functools.partial(_inner_layers_step, {"reverse": True, **kwargs})
        got = tx.scan(fn, init, xs)
        assert_close((got, grads(got, [init, xs])), (expected, expected_grads))
        hlo[name] = tx.lower(fn, init, xs)
    # What the inner forward loop keeps for its backward, and how many steps an
    # iteration runs, are the inner call's to choose.
    assert hlo["save_nothing"].forward_hlo != hlo["default"].forward_hlo
    assert (_instructions(hlo["unroll"].forward_hlo).count("call")
            > _instructions(hlo["default"].forward_hlo).count("call"))


def test_inner_scan_that_draws_random_numbers_runs_unrolled_with_fresh_masks_per_step():
    ones = torch.ones(2, 64, device=DEV)

    def outer(c, x):
        def inner(h, row):
            return h, torch.nn.functional.dropout(row, 0.5)
        return tx.scan(inner, c, x)

    _, masks = tx.scan(outer, randn(3), ones.expand(2, 2, 64).contiguous())
    torch_xla.sync()
    masks = masks.cpu()
    assert not torch.equal(masks[0], masks[1])  # a loop of its own would repeat its seeds
    assert not torch.equal(masks[0, 0], masks[0, 1])
    with pytest.warns(NestedScanWarning, match=r"runs unrolled into the outer step because "
                                                  r"fn draws random numbers \(dropout\).*its "
                                                  r"unroll has no effect"):
        tx.scan(lambda c, x: tx.scan(lambda h, row: (h, torch.nn.functional.dropout(row, 0.5)),
                                     c, x, unroll=2), randn(3), ones.expand(2, 2, 64))


def test_inner_scan_traced_at_every_call_runs_unrolled_and_matches_the_loop():
    weight = randn(3, grad=True)
    init, xs = randn(3, grad=True), randn(2, 4, 3, grad=True)

    def inner_step(c, row):
        return torch.sin(c * weight + row), c

    got = tx.scan(lambda c, x: tx.scan(inner_step, c, x, is_fn_pure=False), init, xs)
    expected = scan_loop(lambda c, x: scan_loop(inner_step, c, x), init, xs)
    assert_close((got, grads(got, [init, xs, weight])),
                 (expected, grads(expected, [init, xs, weight])))


def test_inner_scan_of_no_steps_returns_init_and_empty_ys():
    def outer(c, x):
        inner_carry, ys = tx.scan(lambda c, row: (c + row, (c * 2, None)), c, x[:0])
        return inner_carry + 1, ys

    init, xs = randn(3), randn(2, 4, 3)
    carry, (ys, nones) = tx.scan(outer, init, xs)
    assert ys.shape == (2, 0, 3) and nones is None
    assert_close(carry, init + 2)


def test_nested_errors_are_those_of_a_scan_or_say_not_supported():
    init, xs = randn(3), randn(2, 4, 3)
    with pytest.raises(TypeError, match=r"fn changed the type of carry leaf carry: init has "
                                        r"float32\[3\] but fn returned float64\[3\]"):
        tx.scan(lambda c, x: tx.scan(lambda c, row: (c.double(), None), c, x), init, xs)
    with pytest.raises(TypeError, match=r"y leaves must be tensors or None"):
        tx.scan(lambda c, x: tx.scan(lambda c, row: (c, "y"), c, x), init, xs)
    with pytest.raises(NotImplementedError, match=r"nested scans on their own is not supported, "
                                                  r"since a nested scan's loop is part of the "
                                                  r"outer step's HLO"):
        tx.scan(lambda c, x: (c, tx.lower(lambda c, row: (c, row), c, x).forward_hlo), init, xs)
    counter = torch.zeros((), device=DEV)

    def counting(c, row):
        counter.add_(1)
        return c, row

    with pytest.raises(NotImplementedError, match=r"nested scans over xs of 0 steps whose fn "
                                                  r"writes in place \(add_\) to a float32\[\] "
                                                  r"tensor it did not make are not supported"):
        tx.scan(lambda c, x: tx.scan(counting, c, x[:0]), init, xs)


class ChunkScanner(nn.Module):
    """A layer that scans over the chunks (rows) of its input."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, hidden, chunk_scan=tx.scan):
        def step(c, chunk):
            c = torch.tanh(self.linear(chunk) + c)
            return c, c * 2

        last, ys = chunk_scan(step, hidden[0], hidden)
        return ys + last


def test_layer_stack_of_layers_that_scan_matches_the_loop():
    torch.manual_seed(0)
    layers = [ChunkScanner() for _ in range(3)]
    loop_layers = copy.deepcopy(nn.ModuleList(layers)).to(DEV)
    stack = LayerStack(layers).to(DEV)
    hidden = randn(4, 3, grad=True)
    got = stack(hidden)
    expected = hidden
    for layer in loop_layers:
        expected = layer(expected, chunk_scan=scan_loop)
    assert_close(got, expected)
    names = [name for name, _ in stack.stacked.named_parameters()]
    got_grads = grads(got, [hidden, *(stack.stacked.get_parameter(name) for name in names)])
    loop_params = [layer.get_parameter(name) for name in names for layer in loop_layers]
    expected_grads = grads(expected, [hidden, *loop_params])
    # Each stacked gradient, unstacked along the layers, against the loop's per-layer ones.
    assert_close([got_grads[0]]
                 + [layer_grad for stacked in got_grads[1:] for layer_grad in stacked],
                 list(expected_grads))
