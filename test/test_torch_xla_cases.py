"""PyTorch/XLA's own tests of scan, scan_layers and placeholders, run against torch_xla_ext.

Each case below restates, in our own code, one behavioural test of pytorch/xla's
test/scan/test_scan.py, test/scan/test_scan_layers.py and test/test_placeholder.py,
with torch_xla's functions rebound to ours: `torch_xla.experimental.scan.scan` ->
`torch_xla_ext.scan.scan`, `torch_xla.experimental.scan_layers.scan_layers` ->
`torch_xla_ext.scan_layers`, `torch_xla.core.xla_builder.create_placeholder_tensor` ->
`torch_xla_ext.placeholder`. Cases keep torch_xla's test names, less the
`test_`/`test_scan_` prefix.

Left out or narrowed, and why:
- Error texts ("mismatched keys", "Shape mismatch"): torch_xla's wording; only the
  exception type is checked.
- fn_not_callable: torch_xla raises ValueError; a non-callable argument is a TypeError
  here (the project's rule for arguments of the wrong type).
- external_in_place_mutation: torch_xla rejects it with its tracer's AssertionError
  ("FakeTensor"); here the scan must give the for loop's results and leave the
  mutated tensor as the loop does, which is stricter than "does not silently differ".
- input_in_place_mutation: torch_xla's scan accepts the fn and only the reference
  loop raises; here scan itself must raise, as the loop does. Added:
  input_in_place_mutation_without_grad, the same fn where the loop runs it.
- tree_flatten_none: a torch_xla helper; the case runs on our helper with the same
  job, `torch_xla_ext.scan.avals.flatten` (and `Structure.unflatten`).
- value_and_grad_partitioned (transform_linear_layer, transform_non_trivial_pytree):
  torch_xla's internal forward/backward pair and its activation layout; what they
  check, one step's values and gradients, is checked through a one-step scan.
- cannot_get_handle_from_deleted_pjrt_buffer: torch_xla's buffer donation; kept as far
  as it concerns us: `torch_xla_ext.is_placeholder` reports a donated tensor.

How the cases run: a broken scan can kill the process (SIGSEGV), so the cases of a
group run in one fresh interpreter (`run_isolated`), which reports each case as a JSON
line. A case passes when it reported success and its process went on or exited with
0; a case during which the process died or hung fails with the exit code, and the
group's remaining cases resume in a new interpreter. Each case is its own pytest test
(`test_scan[simple]`, ...); the first test of a group runs the group's selected cases
once and later ones read the cached result.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import signal
import subprocess
import time
import traceback
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.debug.metrics as met
from functorch.compile import default_partition, min_cut_rematerialization_partition
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from torch_xla_ext import is_placeholder, placeholder, placeholder_id, scan_layers
from torch_xla_ext.scan import scan
from torch_xla_ext.scan.avals import flatten
from reference import scan_loop
from tolerances import DTYPE_DEFAULT, LARGE_VALUES, TORCH_XLA_LAYERS, TRAINING, close

DEV = torch_xla.device()

# group -> case name -> case function; filled by @case.
GROUPS: dict[str, dict[str, Callable[[], None]]] = {"scan": {}, "scan_layers": {}, "placeholder": {}}


def case(group: str):
    def register(fn):
        GROUPS[group][fn.__name__] = fn
        return fn
    return register


# ---------------------------------------------------------------------------
# Helpers, as torch_xla's test base classes provide them

def total(tree):
    """The sum of every leaf's sum, the one loss that reaches every output."""
    return sum(leaf.sum() for leaf in tree_leaves(tree) if leaf is not None)


def fresh_copy(tree):
    return tree_map(lambda v: v.detach().clone().requires_grad_(v.requires_grad), tree)


def grads(tree):
    return tree_map(lambda v: v.grad, tree)


def run_test(fn, init, xs, partition_fn=default_partition):
    """Scans `fn` and loops it over copies of `init` and `xs`; values and the
    gradients of one backward through every output must agree."""
    init_scan, xs_scan = fresh_copy(init), fresh_copy(xs)
    final_carry, ys = scan(fn, init_scan, xs_scan, partition_fn=partition_fn)
    total((final_carry, ys)).backward()
    torch_xla.sync()

    init_loop, xs_loop = fresh_copy(init), fresh_copy(xs)
    expected_carry, expected_ys = scan_loop(fn, init_loop, xs_loop)
    total((expected_carry, expected_ys)).backward()
    torch_xla.sync()

    close(final_carry, expected_carry, DTYPE_DEFAULT)
    close(ys, expected_ys, DTYPE_DEFAULT)
    close(grads(init_scan), grads(init_loop), DTYPE_DEFAULT)
    close(grads(xs_scan), grads(xs_loop), DTYPE_DEFAULT)
    return final_carry, ys


def tensor(values, requires_grad=False, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype, device=DEV, requires_grad=requires_grad)


def assert_while_found_in_hlo(t: torch.Tensor):
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([t])
    for part in ("while(", "condition=", "body="):
        assert part in hlo, f"no {part!r} in the HLO of a {tuple(t.shape)} result"


# ---------------------------------------------------------------------------
# test/scan/test_scan.py

@case("scan")
def simple():
    def step(carry, x):
        new_carry = carry + x
        return new_carry, new_carry

    init = tensor([0.0, 0.0], requires_grad=True)
    xs = tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], requires_grad=True)
    final_carry, ys = run_test(step, init, xs)
    # scan as cumsum, checked against the closed form too
    close(final_carry, xs.sum(0) + init, DTYPE_DEFAULT)
    close(ys, xs.cumsum(0), DTYPE_DEFAULT)


@case("scan")
def fn_not_callable():
    init = tensor([1.0, 1.0])
    xs = tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    with pytest.raises(TypeError):
        scan(1000, init, xs)


@case("scan")
def incompatible_length():
    init = tensor([1.0, 1.0])
    xs_1 = tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    xs_2 = tensor([[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(ValueError):
        scan(lambda a, b: (a, b), init, (xs_1, xs_2))


@case("scan")
def tuples():
    def fn(carry, x):
        (c1, c2), (x1, x2) = carry, x
        c1, c2 = c1 + x1.sum(), c2 + x2.sum()
        return (c1, c2), (x1 * 2 + c1.sum(), x2 * 2 + c2.sum())

    init = (tensor([0.0], requires_grad=True), tensor([1.0, 2.0], requires_grad=True))
    xs = (tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True),
          tensor([[5.0, 6.0, 7.0], [8.0, 9.0, 10.0]], requires_grad=True))
    run_test(fn, init, xs)


def step_creating_tensors():
    """A new fn each time, so that each case traces it."""
    def fn(carry, x):
        a = tensor([1.0, 2.0])
        b = tensor([3.0, 4.0])
        return carry + a, x + b
    return fn


@case("scan")
def create_tensors():
    init = tensor([0.0, 0.0], requires_grad=True)
    xs = tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], requires_grad=True)
    run_test(step_creating_tensors(), init, xs)


@case("scan")
def create_tensors_no_transfers_from_device():
    init = tensor([0.0, 0.0], requires_grad=True)
    xs = tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], requires_grad=True)
    met.clear_all()
    assert not met.metric_data("TransferFromDeviceTime")
    scan(step_creating_tensors(), init, xs)
    torch_xla.sync(wait=True)
    assert not met.metric_data("TransferFromDeviceTime"), met.metric_data("TransferFromDeviceTime")


@case("scan")
def internal_in_place_mutation():
    def fn(carry, x):
        carry = carry.clone()
        carry.add_(x)
        y = x.clone()
        y.add_(42)
        return carry, y

    init = tensor([0.0, 0.0], requires_grad=True)
    xs = tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], requires_grad=True)
    run_test(fn, init, xs)


@case("scan")
def input_output_aliases_carry():
    init = tensor([0.0, 0.0], requires_grad=True)
    xs = tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], requires_grad=True)
    run_test(lambda carry, x: (carry, x + 1), init, xs)


@case("scan")
def input_output_aliases_x():
    init = tensor([0.0, 0.0], requires_grad=True)
    xs = tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], requires_grad=True)
    run_test(lambda carry, x: (carry + 1, x), init, xs)


def mutate_carry(carry, x):
    carry.add_(x)
    y = x.clone()
    y.add_(42)
    return carry, y


@case("scan")
def input_in_place_mutation():
    # As in the loop, where the carry is a leaf that requires grad: an error
    # about the in-place write, raised here by scan itself.
    init = tensor([0.0, 0.0], requires_grad=True)
    xs = tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], requires_grad=True)
    with pytest.raises(RuntimeError, match="(?i)in-place"):
        scan(mutate_carry, init, xs)


@case("scan")
def input_in_place_mutation_without_grad():
    # The same fn without gradients, which the loop runs: scan must give the
    # loop's results or refuse the in-place write, never differ silently.
    init = tensor([0.0, 0.0])
    xs = tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    try:
        got = scan(mutate_carry, init.clone(), xs)
    except (RuntimeError, TypeError, ValueError) as error:
        assert re.search("(?i)in-place", str(error)), f"unclear error: {error!r}"
        return
    close(got, scan_loop(mutate_carry, init.clone(), xs), DTYPE_DEFAULT)


@case("scan")
def external_in_place_mutation():
    def make_step(weird_global):
        def step(carry, x):
            new_carry = carry + x
            weird_global.add_(1.0)
            return new_carry, new_carry + weird_global
        return step

    init = tensor([0.0, 0.0])
    xs = tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    scanned_global, looped_global = tensor([0.0, 0.0]), tensor([0.0, 0.0])
    got = scan(make_step(scanned_global), init, xs)
    expected = scan_loop(make_step(looped_global), init, xs)
    close(got, expected, DTYPE_DEFAULT)
    close(scanned_global, looped_global, DTYPE_DEFAULT)


def gradness(init_requires_grad: bool, xs_requires_grad: bool):
    def fn(carry, x):
        new_carry = carry * x
        return new_carry, new_carry + x

    init = tensor([1.0, 1.0], requires_grad=init_requires_grad)
    xs = tensor([[2.0, 3.0], [4.0, 5.0], [6.0, 7.0]], requires_grad=xs_requires_grad)
    run_test(fn, init, xs)


@case("scan")
def gradness_init_and_xs():
    gradness(True, True)


@case("scan")
def gradness_init_only():
    gradness(True, False)


@case("scan")
def gradness_xs_only():
    gradness(False, True)


@case("scan")
def output_none():
    init = tensor([1.0, 1.0], requires_grad=True)
    xs = tensor([[2.0, 3.0], [4.0, 5.0], [6.0, 7.0]], requires_grad=True)
    _, ys = run_test(lambda carry, x: (torch.cos(carry) + x, None), init, xs)
    assert ys is None


@case("scan")
def output_unit():
    init = tensor([1.0, 1.0], requires_grad=True)
    xs = tensor([[2.0, 3.0], [4.0, 5.0], [6.0, 7.0]], requires_grad=True)
    _, ys = run_test(lambda carry, x: (torch.cos(carry) + x, ()), init, xs)
    assert ys == ()


@case("scan")
def rand_in_fn():
    def step(carry, x):
        new_carry = carry + x
        return new_carry, new_carry + torch.rand(2, device=DEV)

    _, ys = scan(step, tensor([0.0, 0.0]), tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    assert ys.shape == (3, 2)
    values = ys.cpu()
    # each step draws its own random numbers
    assert values[0, 0] != values[1, 0] and values[0, 1] != values[1, 1], values


SINE_OP = re.compile(r" sine\(f32\b")


@case("scan")
def with_rematerialization():
    def fn(carry, x):
        for _ in range(10):
            carry = torch.sin(carry)
        for _ in range(10):
            x = torch.sin(x)
        return carry, x

    torch.manual_seed(0)
    carry = torch.randn(4, 4, device=DEV, requires_grad=True)
    xs = torch.randn(20, 4, 4, device=DEV, requires_grad=True)
    carry_remat, ys_remat = run_test(fn, carry, xs, partition_fn=min_cut_rematerialization_partition)
    carry_saved, ys_saved = run_test(fn, carry, xs)
    close(carry_remat, carry_saved, DTYPE_DEFAULT)
    close(ys_remat, ys_saved, DTYPE_DEFAULT)
    torch_xla.sync()

    def sines_in_backward(partition_fn) -> int:
        """The sine ops in the HLO of the gradients once the forward has run:
        a partitioner that recomputes the forward in the backward adds them."""
        own_carry = carry.detach().clone().requires_grad_()
        own_xs = xs.detach().clone().requires_grad_()
        final_carry, ys = scan(fn, own_carry, own_xs, partition_fn=partition_fn)
        torch_xla.sync()
        (final_carry.sum() + ys.sum()).backward()
        assert own_carry.grad is not None and own_xs.grad is not None
        return len(SINE_OP.findall(torch_xla._XLAC._get_xla_tensors_hlo(
            [own_carry.grad, own_xs.grad])))

    assert sines_in_backward(min_cut_rematerialization_partition) > 10
    assert sines_in_backward(default_partition) == 0


@case("scan")
def different_dtypes():
    def fn(carry, x):
        bf16_value, f32_value = x
        return torch.sin(carry), (torch.sin(bf16_value), torch.sin(f32_value))

    init = tensor([0.0, 0.0], requires_grad=True, dtype=torch.float16)
    bf16_xs = tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], requires_grad=True, dtype=torch.bfloat16)
    f32_xs = tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], requires_grad=True)
    final_carry, (bf16_ys, f32_ys) = run_test(fn, init, (bf16_xs, f32_xs))
    assert (final_carry.dtype, bf16_ys.dtype, f32_ys.dtype) == (
        torch.float16, torch.bfloat16, torch.float32)


@case("scan")
def tree_flatten_none():
    tree = ((1, 2), (None, 3), None)
    leaves, structure = flatten(tree)
    assert tuple(leaves) == (1, 2, 3)
    assert structure.unflatten(leaves) == tree


@case("scan")
def transform_linear_layer():
    def fn(carry, x):
        new_carry = carry @ x
        return new_carry, new_carry

    init = tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    xs = tensor([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]])
    one_step = xs[:1].clone().requires_grad_()
    new_carry, ys = scan(fn, init, one_step)
    x = xs[0]
    close((new_carry, ys[0]), (init @ x, init @ x), DTYPE_DEFAULT)

    grad_new_carry, grad_ys = torch.ones_like(new_carry), torch.ones_like(ys)
    grad_carry, grad_x = torch.autograd.grad((new_carry, ys), (init, one_step),
                                             (grad_new_carry, grad_ys))
    upstream = grad_new_carry + grad_ys[0]
    close((grad_carry, grad_x[0]), (upstream @ x.T, init.T @ upstream), DTYPE_DEFAULT)


@case("scan")
def transform_non_trivial_pytree():
    def fn(carry, x):
        new_a = torch.sin(carry["a"] @ x["weights"] + x["biases"])
        new_b = torch.cos(carry["b"] @ x["weights"] + x["biases"])
        return {"a": new_a, "b": new_b}, torch.sigmoid(new_a + new_b)

    torch.manual_seed(0)
    init = {"a": torch.randn(2, 3, device=DEV, requires_grad=True),
            "b": torch.randn(2, 3, device=DEV, requires_grad=True)}
    x = {"weights": torch.randn(3, 3, device=DEV), "biases": torch.randn(2, 3, device=DEV)}
    one_step = tree_map(lambda v: v.unsqueeze(0).requires_grad_(), x)
    carry_out, ys = scan(fn, init, one_step)
    outputs = tree_leaves((carry_out, ys))
    got_grads = torch.autograd.grad(outputs, tree_leaves((init, one_step)),
                                    [torch.ones_like(o) for o in outputs])

    ref_init, ref_x = fresh_copy(init), tree_map(lambda v: v.detach().clone().requires_grad_(), x)
    expected_carry, expected_y = fn(ref_init, ref_x)
    expected_outputs = tree_leaves((expected_carry, expected_y))
    expected_grads = torch.autograd.grad(expected_outputs, tree_leaves((ref_init, ref_x)),
                                         [torch.ones_like(o) for o in expected_outputs])
    close((carry_out, ys[0]), (expected_carry, expected_y), DTYPE_DEFAULT)
    n_init = len(tree_leaves(init))
    close(list(got_grads[:n_init]), list(expected_grads[:n_init]), DTYPE_DEFAULT)
    close([g[0] for g in got_grads[n_init:]], list(expected_grads[n_init:]), DTYPE_DEFAULT)


# ---------------------------------------------------------------------------
# test/scan/test_scan_layers.py

@case("scan_layers")
def empty_layers():
    input_data = torch.randn(64, device=DEV)
    close(scan_layers([], input_data.clone()), input_data, TORCH_XLA_LAYERS)


@case("scan_layers")
def linear_layers():
    torch.manual_seed(42)
    layers = [nn.Linear(64, 64).to(DEV) for _ in range(10)]
    input_data = torch.randn(64, device=DEV)
    torch_xla.sync(wait=True)
    layers_for_scan, layers_for_loop = copy.deepcopy(layers), copy.deepcopy(layers)
    torch_xla.sync()

    output = scan_layers(layers_for_scan, input_data.clone())
    assert_while_found_in_hlo(output)
    output.sum().backward()
    torch_xla.sync()

    loop_output = input_data.clone()
    for layer in layers_for_loop:
        loop_output = layer(loop_output)
    torch_xla.sync()
    close(output, loop_output, TORCH_XLA_LAYERS)
    assert loop_output is not output

    loop_output.sum().backward()
    torch_xla.sync()
    for layer_scan, layer_loop in zip(layers_for_scan, layers_for_loop):
        for name in ("weight", "bias"):
            scan_grad = getattr(layer_scan, name).grad
            loop_grad = getattr(layer_loop, name).grad
            assert scan_grad is not None and loop_grad is not None, name
            close(scan_grad, loop_grad, TORCH_XLA_LAYERS)
            assert scan_grad is not loop_grad


class TupleModule(nn.Module):
    """Takes three tensors and returns three, one per transformation."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 64)
        self.w = nn.Parameter(torch.randn(64, 64))

    def forward(self, x, y, z):
        return self.linear(x).sin(), self.linear(y).cos(), self.linear(z) @ self.w


@case("scan_layers")
def tuple_layers():
    torch.manual_seed(0)
    layers = [TupleModule().to(DEV) for _ in range(10)]
    torch_xla.sync()
    layers_for_scan, layers_for_loop = copy.deepcopy(layers), copy.deepcopy(layers)
    torch_xla.sync()

    # Pending computations rather than device data as inputs.
    shift = torch.randn(64, device=DEV)
    input_data = tuple(torch.randn(64, device=DEV) * scale + shift for scale in (100, 200, 300))
    output = scan_layers(layers_for_scan, input_data)
    assert_while_found_in_hlo(output[0])
    assert_while_found_in_hlo(output[1])
    output[0].sum().backward()
    torch_xla.sync()

    loop_output = input_data
    for layer in layers_for_loop:
        loop_output = layer(*loop_output)
    torch_xla.sync()
    # The third output goes through `@ w` (an unscaled randn matrix) ten times and
    # reaches ~1e9, where cancellation leaves small elements with large relative
    # errors in any float32 run (torch_xla's own scan_layers too): its tolerance
    # is relative to the tensor's largest value.
    for expected, actual in zip(loop_output, output):
        close(actual, expected, LARGE_VALUES)
    assert loop_output[0] is not output[0]

    loop_output[0].sum().backward()
    torch_xla.sync()
    for layer_scan, layer_loop in zip(layers_for_scan, layers_for_loop):
        for name in ("weight", "bias"):
            scan_grad = getattr(layer_scan.linear, name).grad
            loop_grad = getattr(layer_loop.linear, name).grad
            assert scan_grad is not None and loop_grad is not None, name
            close(scan_grad, loop_grad, TORCH_XLA_LAYERS)
            assert scan_grad is not loop_grad


# A small decoder-only language model of our own, built the way such models are:
# a config object held by the submodules, RMS norms, grouped-query attention,
# a gated SiLU MLP and pre-norm residual blocks.

@dataclasses.dataclass
class DecoderConfig:
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 128


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, h):
        scale = torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (h.float() * scale).to(h.dtype)


class GroupedQueryAttention(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_heads
        kv_size = config.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def _heads(self, t, count):
        batch, length, _ = t.shape
        return t.view(batch, length, count, self.head_dim).transpose(1, 2)

    def forward(self, h):
        config = self.config
        q = self._heads(self.q_proj(h), config.num_heads)
        group = config.num_heads // config.num_kv_heads
        k = self._heads(self.k_proj(h), config.num_kv_heads).repeat_interleave(group, dim=1)
        v = self._heads(self.v_proj(h), config.num_kv_heads).repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        weights = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        attended = (weights @ v).transpose(1, 2).reshape(h.shape)
        return self.o_proj(attended)


class GatedMLP(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = F.silu

    def forward(self, h):
        return self.down_proj(self.act_fn(self.gate_proj(h)) * self.up_proj(h))


class DecoderBlock(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.self_attn = GroupedQueryAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size)
        self.mlp = GatedMLP(config)

    def forward(self, h):
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def forward_scan(self, input_ids):
        h = scan_layers(self.layers, self.embed_tokens(input_ids))
        return self.output(self.norm(h))


@case("scan_layers")
def decoder_model():
    torch.manual_seed(42)
    config = DecoderConfig()
    model = DecoderModel(config).to(DEV)
    input_ids = torch.randint(0, config.vocab_size, (2, 8), device=DEV)
    loop_model, scan_model = copy.deepcopy(model), copy.deepcopy(model)
    torch_xla.sync(wait=True)

    loop_output = loop_model(input_ids.clone())
    loop_output.sum().backward()
    torch_xla.sync()

    scan_output = scan_model.forward_scan(input_ids.clone())
    scan_output.sum().backward()
    # The layers run as an XLA While loop, forward and backward.
    assert_while_found_in_hlo(scan_output)
    for layer in scan_model.layers:
        for param in layer.parameters():
            if param.grad is not None:
                assert_while_found_in_hlo(param.grad)
    torch_xla.sync()

    close(scan_output, loop_output, TRAINING)
    checked = 0
    for layer_scan, layer_loop in zip(scan_model.layers, loop_model.layers):
        for (name, param_scan), (name_loop, param_loop) in zip(layer_scan.named_parameters(),
                                                               layer_loop.named_parameters()):
            assert name == name_loop
            assert (param_scan.grad is None) == (param_loop.grad is None), name
            if param_scan.grad is not None:
                assert param_scan.grad is not param_loop.grad
                close(param_scan.grad, param_loop.grad, TRAINING)
                checked += 1
    assert checked > 0


@case("scan_layers")
def heterogenous_layers():
    layer1 = nn.Linear(128, 128).to(DEV)
    layer2 = nn.Sequential(nn.Linear(128, 128).to(DEV))
    with pytest.raises(ValueError):
        scan_layers([layer1, layer2], torch.zeros((128,), device=DEV))


@case("scan_layers")
def mismatched_shapes():
    layer1 = nn.Linear(128, 128).to(DEV)
    layer2 = nn.Linear(128, 129).to(DEV)
    with pytest.raises(ValueError):
        scan_layers([layer1, layer2], torch.zeros((128,), device=DEV))


# ---------------------------------------------------------------------------
# test/test_placeholder.py (every case runs with buffer-donor aliasing on, as there)

@case("placeholder")
def create_placeholder():
    for shape, dtype in zip(((1, 2), (2, 3, 4), (3, 4, 5, 6)),
                            (torch.float32, torch.bfloat16, torch.int8)):
        p = placeholder(shape, dtype)
        assert isinstance(p, torch.Tensor)
        assert p.device == torch_xla.device()
        assert p.dtype == dtype and p.shape == shape
        assert is_placeholder(p)


@case("placeholder")
def read_value_crashes():
    p = placeholder((1,), torch.bfloat16)
    with pytest.raises(RuntimeError):
        p.cpu()


@case("placeholder")
def trace_graph():
    met.clear_all()
    assert not met.metric_data("TransferToDeviceTime")
    p1 = placeholder((2, 3), torch.bfloat16)
    a = torch.sin(p1)
    p2 = placeholder((3, 4), torch.bfloat16)
    # p2 is read twice, yet the graph has one parameter per placeholder.
    b = (a @ p2) @ p2.T
    ir = torch_xla._XLAC._get_xla_tensors_text([b])
    assert ir.count("xla::device_data()") == 2, ir
    assert ir.count("bf16[3,4]{1,0} xla::device_data()") == 1, ir
    assert ir.count("bf16[2,3]{1,0} xla::device_data()") == 1, ir
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([b])
    assert re.search(r"\(p.*: bf16\[3,4\], p.*: bf16\[2,3\]\) -> \(bf16\[2,3\]\)", hlo), hlo
    assert not met.metric_data("TransferToDeviceTime")


@case("placeholder")
def placeholder_handle_unique():
    p1 = placeholder((1,), torch.bfloat16)
    p2 = placeholder((1,), torch.bfloat16)
    h1, h2 = torch_xla._XLAC._get_tensors_handle([p1, p2])
    assert h1 != h2
    assert placeholder_id(p1) != placeholder_id(p2)


@case("placeholder")
def cannot_get_handle_from_deleted_pjrt_buffer():
    t0 = torch.randn(4, 2, 2).to(DEV)
    t1 = torch.randn(4, 2, 2).to(DEV)
    assert torch_xla._XLAC._set_buffer_donation(t0, True)
    assert torch_xla._XLAC._get_buffer_donation(t0)
    _ = t0 + t1
    torch_xla.sync(wait=True)
    # The donated buffer is gone: t0 is left without data, a placeholder.
    assert is_placeholder(t0)
    with pytest.raises(RuntimeError):
        torch_xla._XLAC._get_tensors_handle([t0])


def enable_buffer_donor_aliasing():
    torch_xla._XLAC._xla_set_enable_alias_with_buffer_donor_config(True)


GROUP_SETUP = {"placeholder": enable_buffer_donor_aliasing}


# ---------------------------------------------------------------------------
# Running the cases: a group per subprocess, a pytest test per case

_MARK = "@@torch_xla_case "


def _report(record: dict) -> None:
    print("\n" + _MARK + json.dumps(record), flush=True)


def run_cases(group: str, names: list[str]) -> None:
    """Runs in the subprocess: each case of `names`, reporting its start and outcome."""
    setup = GROUP_SETUP.get(group)
    if setup is not None:
        setup()
    for name in names:
        _report({"name": name, "status": "started"})
        start = time.perf_counter()
        try:
            GROUPS[group][name]()
            status, detail = "passed", ""
        except BaseException as error:  # every failure is reported, even an exit
            status = "failed"
            detail = "".join(traceback.format_exception(error)[-12:])
        _report({"name": name, "status": status, "detail": detail,
                 "seconds": round(time.perf_counter() - start, 2)})


def _case_source(group: str, names: list[str]) -> str:
    return f"""
import faulthandler, importlib.util, sys
faulthandler.enable()  # a crash reports the Python stack on stderr
spec = importlib.util.spec_from_file_location("torch_xla_cases", {__file__!r})
module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.run_cases({group!r}, {names!r})
"""


def _text(output) -> str:
    if output is None:
        return ""
    return output.decode(errors="replace") if isinstance(output, bytes) else output


def _describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "the subprocess timed out"
    if returncode < 0:
        return f"the subprocess died of {signal.Signals(-returncode).name} (rc {returncode})"
    return f"the subprocess exited with rc {returncode}"


def run_group(group: str, names: list[str], run_isolated) -> dict[str, dict]:
    """Runs `names` of `group` in subprocesses, resuming after a case that kills
    or hangs its process; returns each case's record."""
    results: dict[str, dict] = {}
    pending = list(names)
    while pending:
        try:
            process = run_isolated(_case_source(group, pending), timeout=120 + 60 * len(pending))
            stdout, stderr, returncode = process.stdout, process.stderr, process.returncode
        except subprocess.TimeoutExpired as expired:
            stdout, stderr, returncode = _text(expired.stdout), _text(expired.stderr), None
        ran, unfinished = [], None
        for line in stdout.splitlines():
            if line.startswith(_MARK):
                record = json.loads(line[len(_MARK):])
                if record["status"] == "started":
                    unfinished = record["name"]
                else:
                    results[record["name"]] = record
                    ran.append(record["name"])
                    unfinished = None
        stderr_tail = "\n".join(stderr.strip().splitlines()[-15:])
        if returncode != 0 or not ran:
            # The case that started and never finished, else (a crash at exit,
            # or no case ran at all) every case of this run.
            culprits = [unfinished] if unfinished is not None else ran or pending
            for name in culprits:
                results[name] = {
                    "name": name, "status": "crashed",
                    "detail": f"{_describe_exit(returncode)} while running {name}"
                              f"{'' if unfinished else ' or afterwards'}; stderr tail:\n{stderr_tail}"}
        pending = [name for name in pending if name not in results]
    return results


_RESULTS: dict[str, dict[str, dict]] = {}


def check_case(group: str, name: str, request, run_isolated) -> None:
    if name not in _RESULTS.setdefault(group, {}):
        selected = [item.callspec.params["name"] for item in request.session.items
                    if getattr(item, "module", None) is request.module
                    and item.originalname == request.node.originalname]
        todo = [n for n in selected if n not in _RESULTS[group]] or [name]
        _RESULTS[group].update(run_group(group, todo, run_isolated))
    record = _RESULTS[group][name]
    if record["status"] != "passed":
        pytest.fail(f"{group} case {name} {record['status']}:\n{record['detail']}", pytrace=False)


@pytest.mark.parametrize("name", list(GROUPS["scan"]))
def test_scan(name, request, run_isolated):
    check_case("scan", name, request, run_isolated)


@pytest.mark.parametrize("name", list(GROUPS["scan_layers"]))
def test_scan_layers(name, request, run_isolated):
    check_case("scan_layers", name, request, run_isolated)


@pytest.mark.parametrize("name", list(GROUPS["placeholder"]))
def test_placeholder(name, request, run_isolated):
    check_case("placeholder", name, request, run_isolated)
