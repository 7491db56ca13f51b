"""The one closeness check of the tests, `close` (`close_by_name` for dicts),
and its named tolerances.

Each tolerance says why it is as loose as it is; a test picks the tightest one
that holds for what it compares. Subprocess scenarios import it too
(`run_isolated` puts this folder on their path)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class Tolerance(NamedTuple):
    """`torch.testing.assert_close`'s rtol and atol (None: its per-dtype
    defaults); `of_largest` adds that fraction of the expected tensor's
    largest entry to atol."""
    rtol: float | None
    atol: float | None
    of_largest: float | None = None


# A scan's outputs against a Python for loop of the same function: the same
# operations, which XLA may fuse or reorder within a step.
SAME_OPS = Tolerance(rtol=1e-5, atol=1e-6)
# The same in bfloat16: a few roundings to its 8 bits of mantissa (2**-8 each).
BF16_SAME_OPS = Tolerance(rtol=1e-2, atol=1e-6)
# The same operations in the same order, fused differently: a step under
# memory policies that save, recompute or offload its activations, or a for
# loop that casts under autocast as scan does.
SAME_ORDER = Tolerance(rtol=1e-6, atol=1e-6)
# Sums over the steps or over repeated runs (gradients of what every step uses,
# carries and buffers updated in place at each step, cached scans rerun):
# entries summing to near zero keep only an absolute precision.
ACCUMULATED = Tolerance(rtol=1e-5, atol=1e-5)
# Several layers (attention's softmax, norms) or nested scans in one scan body
# against loops over them, and a transformers model's logits or adapters'
# gradients.
THROUGH_LAYERS = Tolerance(rtol=1e-4, atol=1e-5)
# Training, and transformers layers and models: losses, gradients and weights
# after optimizer steps (each step starts from the previous one's rounding),
# the embeddings' gradients summed over every token, and transformers'
# attention and norm kernels, fused differently inside a scan than in a loop.
TRAINING = Tolerance(rtol=1e-4, atol=1e-4)
# The losses transformers' Trainer logs, rounded to 4 decimals: equal, or one
# rounding step apart.
LOGGED_LOSSES = Tolerance(rtol=0.0, atol=1e-4)
# bfloat16 under autocast: a for loop casts a weight to bf16 once and sums that
# cast's gradients over the steps in bf16, scan casts at each step and sums in
# f32; they agree up to bf16 rounding (8 bits of mantissa, 2**-6 with the
# sums' error) of the largest entry.
BF16 = Tolerance(rtol=0.0, atol=0.0, of_largest=2 ** -6)
# torch_xla's own tests of scan_layers (test_torch_xla_cases.py restates
# them): layers of unscaled randn weights, at the tolerance those tests set.
TORCH_XLA_LAYERS = Tolerance(rtol=1e-3, atol=1e-4)
# The same for outputs that grow to ~1e9 through repeated unscaled matmuls,
# where cancellation leaves small entries with large relative errors in any
# float32 run: 1e-5 of the largest entry more.
LARGE_VALUES = Tolerance(rtol=1e-3, atol=1e-4, of_largest=1e-5)
# torch.testing's defaults for the dtype (1.3e-6 and 1e-5 for float32): values
# computed alike or exactly (dropout's scaling, random draws, small sums).
DTYPE_DEFAULT = Tolerance(rtol=None, atol=None)


def close(actual, expected, tolerance: Tolerance, what: str = "") -> None:
    """Asserts that two PyTrees have the same structure, None at the same
    places, and tensors of the same dtype and shape within `tolerance`
    (compared on the host, autograd history dropped, read by `on_host`)."""
    actual, expected = on_host(actual, expected)
    actual_leaves, actual_spec = tree_flatten(actual)
    expected_leaves, expected_spec = tree_flatten(expected)
    assert actual_spec == expected_spec, f"{what}: structure {actual_spec} != {expected_spec}"
    for index, (a, e) in enumerate(zip(actual_leaves, expected_leaves)):
        where = f"{what} (leaf {index})" if len(actual_leaves) > 1 else what
        assert (a is None) == (e is None), f"{where}: {a} where {e} was expected"
        if a is None:
            continue
        rtol, atol = tolerance.rtol, tolerance.atol
        if tolerance.of_largest is not None:
            largest = e.float().abs().max().item()
            assert largest > 0, f"{where}: the expected tensor is all zeros"
            rtol, atol = rtol or 0.0, (atol or 0.0) + tolerance.of_largest * largest
            assert (a.dtype, a.shape) == (e.dtype, e.shape), f"{where}: {a.dtype}{list(a.shape)}"
            a, e = a.float(), e.float()
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol,
                                   msg=(lambda message: f"{where}: {message}") if where else None)


def close_by_name(actual: dict, expected: dict, tolerance: Tolerance) -> None:
    """Asserts that two dicts have the same keys and `close` entries under
    each (a failure names the key)."""
    assert actual.keys() == expected.keys(), (
        f"keys only in actual {sorted(actual.keys() - expected.keys())}, "
        f"only in expected {sorted(expected.keys() - actual.keys())}")
    actual, expected = on_host(actual, expected)
    for name, value in expected.items():
        close(actual[name], value, tolerance, what=name)


def on_host(*trees):
    """`trees` with each tensor detached and copied to the host, the lazy XLA
    tensors among them computed in one execution: read one by one, each would
    compile and run a graph of its own (a model's outputs, the slices of a
    stacked gradient)."""
    leaves, spec = tree_flatten(trees)
    leaves = [None if leaf is None else leaf.detach() for leaf in leaves]
    lazy = [leaf for leaf in leaves if leaf is not None and leaf.device.type == "xla"]
    if lazy:
        import torch_xla
        torch_xla._XLAC._xla_sync_multi(lazy, devices=[], wait=True, sync_xla_data=False)
    return tree_unflatten([None if leaf is None else leaf.cpu() for leaf in leaves], spec)
