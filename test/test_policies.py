"""Activation memory policies: every policy gives the for loop's gradients;
what each keeps shows in the buffers its forward loop stacks; `lower` shows the
loops a TPU would run (host placements of `offload`) without running them."""
import re
import warnings

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
from torch import nn

import torch_xla_ext as tx
from torch_xla_ext import policies
from reference import host_copies, scan_loop
from tolerances import ACCUMULATED, SAME_ORDER, close

DEV = torch_xla.device()
POLICIES = [policies.save_everything, policies.save_nothing, policies.save_dots,
            policies.save_only("h"), policies.offload("h"), "save_nothing"]


class Step(nn.Module):
    """A step whose backward needs many activations: two linear layers, a
    named tanh and a sine."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, c, x):
        h = tx.checkpoint_name(torch.tanh(self.up(c + x)), "h")
        a = tx.checkpoint_name(self.down(h).sin(), "a")
        return c * a + x, a.sum()


def gradients(step, policy, init, xs):
    params = [init, *step.parameters()]
    for p in params:
        p.grad = None
    carry, ys = tx.scan(step, init, xs, partition_fn=policy)
    (carry.sum() + ys.sum()).backward()
    return [carry, ys] + [p.grad for p in params]


def inputs(length=5):
    torch.manual_seed(1)
    return (torch.randn(4, 8, device=DEV, requires_grad=True),
            torch.randn(length, 4, 8, device=DEV))


@pytest.fixture(autouse=True)
def no_offload_warning_state(monkeypatch):
    monkeypatch.setattr(policies, "_warned_kinds", set())


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_every_policy_gives_the_loops_gradients(policy):
    step = Step().to(DEV)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", policies.OffloadWarning)
        assert_gives_the_loops_gradients(step, policy, *inputs())


def assert_gives_the_loops_gradients(step, policy, init, xs):
    scanned = host_copies(gradients(step, policy, init, xs))
    for p in [init, *step.parameters()]:
        p.grad = None
    carry, ys = scan_loop(step, init, xs)
    (carry.sum() + ys.sum()).backward()
    looped = host_copies([carry, ys] + [p.grad for p in [init, *step.parameters()]])
    for s, l in zip(scanned, looped):
        close(s, l, ACCUMULATED)


def test_random_ops_are_kept_not_drawn_again_in_the_backward():
    # fn returns its dropout masks as ys; the loop given those masks is the
    # reference. A mask drawn again for the backward would differ from it.
    up, down = nn.Linear(8, 16).to(DEV), nn.Linear(16, 8).to(DEV)

    def fn(c, x, mask=None):
        h = torch.tanh(up(c + x))
        if mask is None:
            mask = nn.functional.dropout(torch.ones_like(h), 0.5)
        return c * down(h * mask).sin(), mask

    init, xs = inputs()
    params = [init, *up.parameters(), *down.parameters()]
    for policy in (policies.save_nothing, policies.save_dots):
        for p in params:
            p.grad = None
        carry, masks = tx.scan(fn, init, xs, partition_fn=policy)
        carry.sum().backward()
        scanned = host_copies([p.grad for p in params])
        masks = masks.detach()
        assert 0 < (masks == 0).sum() < masks.numel()
        for p in params:
            p.grad = None
        scan_loop(lambda c, xm: fn(c, *xm), init, (xs, masks))[0].sum().backward()
        for s, l in zip(scanned, host_copies([p.grad for p in params])):
            close(s, l, ACCUMULATED)


def stacked_buffers(hlo: str, length: int) -> list[str]:
    """The shapes of the [length, ...] buffers a loop's while state holds."""
    state = next(line for line in hlo.splitlines() if re.search(r"= \(.*\) while\(", line))
    shapes = re.findall(r"(\w+\[[\d,]*\])", state.split(" while(")[0])
    return [s for s in shapes if re.match(rf"\w+\[{length},", s)]


def test_what_each_policy_stacks():
    step = Step().to(DEV)
    init, xs = inputs(length=7)
    stacked = {repr(p): stacked_buffers(tx.lower(step, init, xs, partition_fn=p).forward_hlo, 7)
               for p in (policies.save_everything, policies.save_nothing, policies.save_dots,
                         policies.save_only("h"))}
    # The forward loop always holds xs; save_nothing then stacks only the carry.
    assert sorted(stacked["save_nothing"]) == ["f32[7,4,8]", "f32[7,4,8]"], stacked
    assert sorted(stacked["save_only('h')"]) == ["f32[7,4,16]", "f32[7,4,8]", "f32[7,4,8]"], stacked
    # save_dots keeps both linear layers' outputs (and the carry), not tanh's or sin's.
    assert sorted(stacked["save_dots"]) == sorted(
        ["f32[7,4,16]", "f32[7,4,8]", "f32[7,4,8]", "f32[7,4,8]"]), stacked
    # save_everything keeps what tanh's and sin's backward read; c + x and
    # sin's output, elementwise of the step's inputs and of kept values, it
    # recomputes.
    assert sorted(stacked["save_everything"]) == sorted(
        ["f32[7,4,16]", "f32[7,4,8]", "f32[7,4,8]", "f32[7,4,8]"]), stacked


class ViewedStep(nn.Module):
    """A step whose backward reads a value and a reshaped view of it: tanh's
    backward reads its output `h`, and `h_heads * h_heads` reads `h_heads`."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)

    def forward(self, c, x):
        h = torch.tanh(self.up(c + x))
        h_heads = h.view(4, 2, 8)
        return c + (h_heads * h_heads).sum(1), h.sum()


def test_save_everything_stacks_a_value_and_its_view_once():
    step = ViewedStep().to(DEV)
    init, xs = inputs(length=7)
    forward = tx.lower(step, init, xs, partition_fn=policies.save_everything).forward_hlo
    stacked = stacked_buffers(forward, 7)
    assert "f32[7,4,16]" in stacked, stacked  # h itself
    assert "f32[7,4,2,8]" not in stacked, stacked  # its view, redone in the backward
    assert_gives_the_loops_gradients(step, policies.save_everything, init, xs)


class SwiGLUStep(nn.Module):
    """down(silu(gate(x)) * up(x)): the backward reads gate(x), up(x),
    silu(gate(x)) and their product, the last two elementwise of the first."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, c, x):
        return c + self.down(torch.nn.functional.silu(self.gate(c + x)) * self.up(c + x)), c.sum()


def test_save_everything_recomputes_what_elementwise_ops_make_from_kept_values():
    step = SwiGLUStep().to(DEV)
    init, xs = inputs(length=7)
    wide = {repr(policy): stacked_buffers(tx.lower(step, init, xs, partition_fn=policy)
                                          .forward_hlo, 7).count("f32[7,4,16]")
            for policy in (policies.save_everything, policies.save_dots)}
    # gate(x) and up(x) only, as save_dots keeps them: not silu(gate(x)) nor the product.
    assert wide == {"save_everything": 2, "save_dots": 2}, wide
    assert_gives_the_loops_gradients(step, policies.save_everything, init, xs)


class FlattenedSwiGLUStep(SwiGLUStep):
    """SwiGLUStep on [2, 2, 8] rows: nn.Linear flattens silu(gate) * up to
    [4, 16] for the down projection, whose backward reads that view."""

    def forward(self, c, x):
        rows = (c + x).view(2, 2, 8)
        mixed = torch.nn.functional.silu(self.gate(rows)) * self.up(rows)
        return c + self.down(mixed).view(4, 8), c.sum()


def test_save_everything_recomputes_a_view_of_what_elementwise_ops_make():
    step = FlattenedSwiGLUStep().to(DEV)
    init, xs = inputs(length=7)
    stacked = stacked_buffers(tx.lower(step, init, xs, partition_fn=policies.save_everything)
                              .forward_hlo, 7)
    # gate(rows) and up(rows) only, not the product nor its flattened view.
    assert len([shape for shape in stacked if shape.endswith(",16]")]) == 2, stacked
    assert_gives_the_loops_gradients(step, policies.save_everything, init, xs)


class ExpertsStep(nn.Module):
    """Each row goes through the expert a router picks from the carry, whose
    weight is gathered for the row, and is weighted by the router's score
    (transformers' batched_mm experts): the backward reads the gathered
    weights [4, 8, 8]."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 3)
        self.experts = nn.Parameter(torch.randn(3, 8, 8) / 3)

    def forward(self, c, x):
        score, expert = self.router(c).softmax(-1).max(-1)
        rows = torch.bmm(self.experts[expert], (c + x).unsqueeze(-1)).squeeze(-1)
        return c + score[:, None] * rows, c.sum()


def test_save_everything_gathers_a_weights_rows_again_rather_than_stacking_them():
    step = ExpertsStep().to(DEV)
    init, xs = inputs(length=7)
    stacked = stacked_buffers(tx.lower(step, init, xs, partition_fn=policies.save_everything)
                              .forward_hlo, 7)
    assert "f32[7,4,8,8]" not in stacked, stacked
    assert_gives_the_loops_gradients(step, policies.save_everything, init, xs)


def test_a_policy_made_afresh_shares_the_trace():
    step = Step().to(DEV)
    init, xs = inputs()
    tx.cache_clear()
    for _ in range(3):
        gradients(step, policies.save_only("h"), init, xs)
    gradients(step, "save_nothing", init, xs)
    gradients(step, policies.save_nothing, init, xs)
    info = tx.cache_info()
    assert (info.misses, info.hits) == (2, 3), info


def test_offload_without_host_memory_warns_once_and_keeps_the_tensors():
    step = Step().to(DEV)
    init, xs = inputs()
    expected = host_copies(gradients(step, policies.save_everything, init, xs))
    with pytest.warns(policies.OffloadWarning, match=r"offload\('h'\): CPU devices have no "
                                                     r"host memory"):
        offloaded = host_copies(gradients(step, policies.offload("h"), init, xs))
    with warnings.catch_warnings():
        warnings.simplefilter("error", policies.OffloadWarning)
        gradients(step, policies.offload("a", "h"), init, xs)  # warned once per process
    for a, b in zip(offloaded, expected):
        close(a, b, SAME_ORDER)
    lowered = tx.lower(step, init, xs, partition_fn=policies.offload("h"))
    assert "_xla_buffer_placement" not in lowered.forward_hlo + lowered.backward_hlo


def placements(hlo: str) -> list[str]:
    return re.findall(r'_xla_buffer_placement="(\w+)"', hlo)


def test_lower_shows_the_host_placements_a_tpu_would_run_without_running_anything():
    step = Step().to(DEV)
    init = tx.placeholder((4, 8), torch.float32).requires_grad_()
    xs = torch.randn(5, 4, 8)  # a host tensor: only its shape and dtype count
    tx.lower(step, init, xs, partition_fn=policies.offload("h"), device_kind="TPU")
    torch_xla.sync()
    met.clear_all()
    tpu = tx.lower(step, init, xs, partition_fn=policies.offload("h"), device_kind="TPU")
    assert met.metric_data("TransferToDeviceTime") is None
    assert met.metric_data("ExecuteTime") is None
    assert tpu.device_kind == "TPU"
    assert placements(tpu.forward_hlo) == ["pinned_host"]
    assert placements(tpu.backward_hlo) == ["device"]
    # The placed value is h, f32[4,16], and the forward loop stacks it.
    placed = next(line for line in tpu.forward_hlo.splitlines() if "pinned_host" in line)
    assert re.search(r"= f32\[4,16\]", placed), placed
    assert "f32[5,4,16]" in stacked_buffers(tpu.forward_hlo, 5)
    with pytest.warns(policies.OffloadWarning):
        cpu = tx.lower(step, init, xs, partition_fn=policies.offload("h"), device_kind="CPU")
    assert placements(cpu.forward_hlo + cpu.backward_hlo) == []


def test_lower_without_gradients_has_no_backward_loop():
    step = Step().to(DEV).requires_grad_(False)
    lowered = tx.lower(step, torch.zeros(4, 8), torch.zeros(3, 4, 8))
    assert lowered.backward_hlo is None
    assert " while(" in lowered.forward_hlo


def test_policies_reach_layer_stacks_and_stack_lower():
    from torch_xla_ext.workloads import DecoderBlock
    torch.manual_seed(0)
    layers = [DecoderBlock(hidden=16, heads=2) for _ in range(3)]
    hidden = torch.randn(2, 4, 16, device=DEV)
    results = {}
    for policy in ("save_everything", policies.save_nothing):
        stack = tx.LayerStack([l for l in layers], partition_fn=policy).to(DEV)
        stack(hidden).sum().backward()
        results[repr(policy)] = host_copies([p.grad for p in stack.parameters()])
        lowered = stack.lower(hidden, device_kind="TPU")
        results[repr(policy) + " stacked"] = stacked_buffers(lowered.forward_hlo, 3)
    for a, b in zip(results["'save_everything'"], results["save_nothing"]):
        close(a, b, ACCUMULATED)
    # save_nothing stacks the hidden state alone besides the weights.
    assert len(results["save_nothing stacked"]) < len(results["'save_everything' stacked"])
    layers_out = tx.scan_layers([l.to(DEV) for l in layers], hidden, partition_fn="save_dots")
    close(layers_out.cpu(), stack(hidden).cpu(), ACCUMULATED)


def test_bad_policies_and_names_are_refused_naming_them():
    step = Step().to(DEV)
    init, xs = inputs()
    with pytest.raises(ValueError, match=r"unknown policy 'save_dotz'; the policies are "
                                         r"save_everything, save_nothing, save_dots"):
        tx.scan(step, init, xs, partition_fn="save_dotz")
    with pytest.raises(TypeError, match=r"partition_fn must be .* got int 3"):
        tx.scan(step, init, xs, partition_fn=3)
    with pytest.raises(ValueError, match=r"save_only\('z'\): no checkpoint_name in the traced "
                                         r"fn is named 'z'; the names it gives are \['h', 'a'\]"):
        gradients(step, policies.save_only("z"), init, xs)
    with pytest.raises(ValueError, match=r"offload\(\) needs at least one name"):
        policies.offload()
    with pytest.raises(TypeError, match=r"save_only: names must be non-empty strs, got 3"):
        policies.save_only(3)
    with pytest.raises(TypeError, match=r"name must be a non-empty str, got None"):
        tx.checkpoint_name(init, None)
    with pytest.raises(TypeError, match=r"expected a tensor, got list"):
        tx.checkpoint_name([init], "h")
    with pytest.raises(TypeError, match=r"device_kind must be a str"):
        tx.lower(step, init, xs, device_kind=4)


def test_checkpoint_name_outside_a_scan_is_the_tensor_itself():
    t = torch.ones(3, device=DEV, requires_grad=True)
    assert tx.checkpoint_name(t, "h") is t
    cpu = torch.ones(2)
    assert tx.checkpoint_name(cpu, "h") is cpu


def test_layer_stack_lower_places_a_named_activation_on_the_host_for_tpu():
    from torch_xla_ext.workloads import DecoderBlock
    stack = tx.LayerStack([DecoderBlock(hidden=16, heads=2) for _ in range(3)],
                          partition_fn=policies.offload("attn_out")).to(DEV)
    hidden = tx.placeholder((2, 4, 16), torch.float32)
    lowered = stack.lower(hidden, device_kind="TPU")
    assert placements(lowered.forward_hlo) == ["pinned_host"]
    assert placements(lowered.backward_hlo) == ["device"]
    assert "f32[3,2,4,16]" in stacked_buffers(lowered.forward_hlo, 3)
