"""What the cases of `torch_scan_peer_suite.py` share: their registry, their
tensors, the reference loop and the comparisons.

The reference is `for_loop`, the operator's contract as a Python loop run on
the same device as the scan; gradients are those of every output with respect
to the inputs, as torch's tests take them (ones as the outputs' gradients).
"""
from __future__ import annotations

import functools
import itertools

import torch
import torch_xla
from torch._higher_order_ops.scan import scan
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

DEVICE = torch_xla.device()
CASES: dict = {}
FLAGS = {"reverse": (False, True), "autograd": (False, True), "compiled": (False, True)}


def case(name: str, **grid):
    """Registers the decorated function once per combination of `grid`'s values."""
    def register(fn):
        for values in itertools.product(*grid.values()):
            params = dict(zip(grid, values))
            label = ",".join(f"{key}={value}" for key, value in params.items())
            CASES[f"{name}[{label}]" if label else name] = functools.partial(fn, **params)
        return fn
    return register


def tensor(*shape, grad=False, dtype=torch.float32, fill=None):
    """A leaf on the device: random normal, or `fill`."""
    values = torch.randn(*shape) if fill is None else torch.full(shape, float(fill))
    return values.to(dtype).to(DEVICE).requires_grad_(grad)


def scanner(compiled: bool):
    """torch's scan, or torch's scan compiled with the eager backend."""
    return torch.compile(scan, fullgraph=True, backend="eager") if compiled else scan


def for_loop(combine_fn, init, xs, dim=0, reverse=False):
    """The operator's contract: `combine_fn` over the slices of `xs` along
    `dim` (last to first with `reverse`), ys stacked on dim 0 in `xs`'s order."""
    leaves, spec = tree_flatten(xs)
    if not leaves:
        return init, []
    steps = range(leaves[0].shape[dim])
    carry, ys = init, {}
    for i in (reversed(steps) if reverse else steps):
        carry, ys[i] = combine_fn(carry, tree_unflatten([x.select(dim, i) for x in leaves], spec))
    return carry, tree_map(lambda *each: torch.stack(each), *[ys[i] for i in steps])


def _tolerance(dtype):
    return {torch.float32: dict(rtol=1e-5, atol=1e-5),
            torch.complex64: dict(rtol=1e-5, atol=1e-5)}.get(dtype, {})


def check_equal(got, expected, what="results"):
    got_leaves, expected_leaves = tree_leaves(got), tree_leaves(expected)
    assert len(got_leaves) == len(expected_leaves), (
        f"{what}: {len(got_leaves)} leaves, the loop gives {len(expected_leaves)}")
    for i, (g, e) in enumerate(zip(got_leaves, expected_leaves)):
        if not isinstance(e, torch.Tensor):
            assert g == e, f"{what} leaf {i}: {g!r}, the loop gives {e!r}"
            continue
        assert g.device.type == e.device.type and g.dtype == e.dtype, (
            f"{what} leaf {i}: {g.dtype} on {g.device}, the loop gives {e.dtype} on {e.device}")
        torch.testing.assert_close(g.detach().cpu(), e.detach().cpu(), equal_nan=True,
                                   msg=lambda m: f"{what} leaf {i}: {m}", **_tolerance(e.dtype))


def check_grads(got, expected, params):
    """The gradients of every output that requires grad (ones as their
    gradients) with respect to `params`, of the scan and of the loop."""
    params = tree_leaves(params)

    def grads(result):
        outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor) and t.requires_grad]
        found = torch.autograd.grad(outputs, params, [torch.ones_like(t) for t in outputs],
                                    allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for g, p in zip(found, params)]
    check_equal(grads(got), grads(expected), "gradients")


def check(fn, init, xs, dim=0, reverse=False, compiled=False, params=None):
    """torch's scan against the loop, and their gradients with respect to
    `params` when given."""
    got = scanner(compiled)(fn, init, xs, dim=dim, reverse=reverse)
    expected = for_loop(fn, init, xs, dim, reverse)
    check_equal(got, expected)
    if params is not None:
        check_grads(got, expected, params)
    return got


def both(fn):
    """A combine function returning its result as the carry and as the output
    (torch's tests' `associative=False`)."""
    return lambda c, x: (fn(c, x), fn(c, x))


add, mul, div = (lambda c, x: c + x), (lambda c, x: c * x), (lambda c, x: c / x)
