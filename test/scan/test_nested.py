"""Nested scans (scan/inline.py) against nested Python for loops."""
import copy
import functools

import pytest
import torch
import torch_xla
from torch import nn
from torch.utils._pytree import tree_flatten

import torch_xla_ext as tx
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


def test_outer_fn_is_traced_once_and_inner_fn_runs_only_in_that_trace():
    tx.cache_clear()
    runs = {"outer": 0, "inner": 0}
    weight = randn(3)

    def inner_step(c, row):
        runs["inner"] += 1
        return c * weight + row, c

    def outer(c, x):
        runs["outer"] += 1
        return tx.scan(inner_step, c, x)

    init, xs = randn(3), randn(2, 4, 3)
    first = tx.scan(outer, init, xs)
    assert runs == {"outer": 1, "inner": 4}
    second = tx.scan(outer, init, xs)
    assert runs == {"outer": 1, "inner": 4}
    info = tx.cache_info()
    assert (info.hits, info.misses, info.size) == (1, 1, 1)  # the inner scan has no entry
    assert_close(second, first)
    assert_close(first, scan_loop(lambda c, x: scan_loop(inner_step, c, x), init, xs))


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
    with pytest.raises(NotImplementedError, match=r"nested scans on their own is not supported"):
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
