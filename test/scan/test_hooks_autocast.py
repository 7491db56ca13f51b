"""scan under the caller's saved-tensor hooks and under autocast (mixed precision).

What used to crash runs in a fresh interpreter (`run_isolated`), which reports
what it measured as JSON on its last line."""
import copy
import json

import pytest
import torch
import torch_xla

import torch_xla_ext as tx
from torch_xla_ext.workloads import DecoderBlock
from reference import scan_loop
from tolerances import BF16, SAME_ORDER, close

DEV = torch_xla.device()

# Shared by the isolated scenarios: a step closing over an nn.Linear, its
# inputs, and the tensors whose gradients they compare.
def scenario_step():
    dev = torch_xla.device()
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).to(dev)
    c0 = torch.randn(2, 4, device=dev, requires_grad=True)
    xs = torch.randn(3, 2, 4, device=dev, requires_grad=True)

    def step(c, x):
        h = torch.tanh(lin(c) + x)
        return h, h.sum()

    return step, c0, xs, [c0, xs, lin.weight, lin.bias]


def max_diffs(actual, expected):
    """After a sync: on the host, no graph to compile."""
    return [(a.detach().cpu().float() - e.detach().cpu().float()).abs().max().item()
            for a, e in zip(actual, expected)]


def run_scenario(run_isolated, scenario) -> dict:
    result = run_isolated(scenario)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def saved_tensors_hooks_scenario():
    step, c0, xs, params = scenario_step()
    packed, inner_packed = [], []

    def pack(t):
        packed.append(t)  # kept, as a hook that stores tensors elsewhere keeps them
        return t

    def inner_pack(t):
        inner_packed.append(t)
        return t

    def step_with_own_hooks(c, x):
        with torch.autograd.graph.saved_tensors_hooks(inner_pack, lambda t: t):
            return step(c, x)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        final, ys = tx.scan(step, c0, xs)
        inner_final, inner_ys = tx.scan(step_with_own_hooks, c0, xs)
    scan_grads = gradients((final, ys), params)
    inner_grads = gradients((inner_final, inner_ys), params)
    torch_xla.sync()
    expected, loop_grads = for_loop_and_gradients(step, c0, xs, params)
    print(json.dumps({
        "packed": len(packed),
        "placeholders_packed": sum(tx.is_placeholder(t) or tx.depends_on_placeholder(t)
                                   for t in packed + inner_packed),
        "inputs_packed_as_themselves": [any(t is p for t in packed) for p in params],
        "output_diff": max_diffs([final, ys], expected),
        "grad_diff": max_diffs(scan_grads, loop_grads),
        "own_hooks_grad_diff": max_diffs(inner_grads, loop_grads),
    }))


def test_saved_tensors_hooks_see_scans_inputs_and_activations_never_placeholders(run_isolated):
    # Was: the hooks received the placeholders of the trace; rc 139 at the sync.
    seen = run_scenario(run_isolated, saved_tensors_hooks_scenario)
    assert seen["placeholders_packed"] == 0
    assert seen["inputs_packed_as_themselves"] == [True, True, True, True]
    assert seen["packed"] > 4  # the inputs and the stacked activations
    assert max(seen["output_diff"]) < 1e-6
    assert max(seen["grad_diff"]) < 1e-5
    assert max(seen["own_hooks_grad_diff"]) < 1e-5


def save_on_cpu_scenario():
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    step, c0, xs, params = scenario_step()
    hooks = torch.autograd.graph.save_on_cpu()
    pack_to_cpu = hooks.pack_hook
    copied_to = []

    def observed_pack(t):
        packed = pack_to_cpu(t)
        copied_to.append(packed[1].device.type)
        return packed

    hooks.pack_hook = observed_pack
    torch_xla.sync()
    xm.wait_device_ops()
    met.clear_all()
    with hooks:
        final, ys = tx.scan(step, c0, xs)
    executions = met.metric_data("ExecuteTime")[0]
    scan_grads = gradients((final, ys), params)
    torch_xla.sync()
    expected, loop_grads = for_loop_and_gradients(step, c0, xs, params)
    print(json.dumps({
        "copied_to": copied_to,
        "executions": executions,
        "output_diff": max_diffs([final, ys], expected),
        "grad_diff": max_diffs(scan_grads, loop_grads),
    }))


def test_save_on_cpu_moves_scans_saved_tensors_to_the_host(run_isolated):
    # Was: RuntimeError "... while an async operation is in flight" from the
    # .cpu() of a tensor the trace computed from placeholders.
    seen = run_scenario(run_isolated, save_on_cpu_scenario)
    assert len(seen["copied_to"]) > 4 and set(seen["copied_to"]) == {"cpu"}
    # The loop ran once for all the copies, not once per saved tensor.
    assert seen["executions"] == 1
    assert max(seen["output_diff"]) < 1e-6
    assert max(seen["grad_diff"]) < 1e-5


def autocast_sync_scenario():
    dev = torch_xla.device()
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16).to(dev)
    xs = torch.randn(3, 2, 16, device=dev)
    params = [lin.weight, lin.bias]
    issue_step = lambda c, x: (lin(c) + x, c.sum())
    with torch.autocast("xla", dtype=torch.bfloat16):
        c, ys = tx.scan(issue_step, torch.zeros(2, 16, device=dev), xs)
        try:
            tx.scan(lambda c, x: (lin(c), c.sum()), torch.zeros(2, 16, device=dev), xs)
            carry_error = None
        except TypeError as error:
            carry_error = str(error)
        torch_xla.sync()  # inside the region, while autocast's cast cache is live
        expected = scan_loop(issue_step, torch.zeros(2, 16, device=dev), xs)
    scan_grads = gradients((c, ys), params)
    loop_grads = gradients(expected, params)
    torch_xla.sync()
    print(json.dumps({
        "dtypes": [str(c.dtype), str(ys.dtype), str(expected[0].dtype), str(expected[1].dtype)],
        "carry_error": carry_error,
        "output_diff": max_diffs([c, ys], expected),
        "grad_diff": max_diffs(scan_grads, loop_grads),
        "grad_scale": [g.cpu().abs().max().item() for g in loop_grads],
    }))


def test_sync_inside_autocast_after_scan(run_isolated):
    # Was: SIGSEGV at the sync; autocast had cached the bf16 cast of the stand-in
    # for lin.weight, which reads a placeholder, and the sync ran it.
    seen = run_scenario(run_isolated, autocast_sync_scenario)
    # The issue's step keeps its f32 carry: lin(c) is bf16, bf16 + f32 x is f32.
    assert seen["dtypes"] == ["torch.float32"] * 4
    assert "init has float32[2,16] but fn returned bfloat16[2,16]" in seen["carry_error"]
    assert max(seen["output_diff"]) < 1e-6
    for diff, scale in zip(seen["grad_diff"], seen["grad_scale"]):
        assert diff <= BF16.of_largest * scale


def gradients(result, params):
    carry, ys = result
    return torch.autograd.grad(carry.float().sum() + ys.float().sum(), params)


def for_loop_and_gradients(step, c0, xs, params):
    """What the for loop of `step` computes, and its gradients, synced."""
    expected = scan_loop(step, c0, xs)
    loop_grads = gradients(expected, params)
    torch_xla.sync()
    return expected, loop_grads


def test_carry_dtype_changed_under_autocast_raises_naming_the_leaf_and_both_dtypes():
    lin = torch.nn.Linear(16, 16).to(DEV)
    init = {"h": torch.zeros(2, 16, device=DEV), "n": torch.zeros((), device=DEV)}
    xs = torch.randn(3, 2, 16, device=DEV)

    def step(carry, x):  # in a for loop, carry["h"] would silently become bf16
        return {"h": torch.tanh(lin(carry["h"])), "n": carry["n"] + 1}, x

    with torch.autocast("xla", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match=r"carry\['h'\]: init has float32\[2,16\] but fn "
                                            r"returned bfloat16\[2,16\]"):
            tx.scan(step, init, xs)


def cast_back(c, x):
    h = torch.tanh(CAST_LIN(c))
    return h.float() + x, h


def bf16_carry(c, x):
    h = torch.tanh(CAST_LIN(c) + x.bfloat16())
    return h, h.sum(-1)


CAST_LIN = torch.nn.Linear(16, 16).to(DEV)


@pytest.mark.parametrize("fn,carry_dtype", [(cast_back, torch.float32),
                                            (bf16_carry, torch.bfloat16)])
def test_autocast_scan_matches_the_loop(fn, carry_dtype):
    torch.manual_seed(0)
    c0 = torch.randn(2, 16, device=DEV, dtype=carry_dtype, requires_grad=True)
    xs = torch.randn(4, 2, 16, device=DEV, requires_grad=True)
    params = [c0, xs, CAST_LIN.weight, CAST_LIN.bias]
    with torch.autocast("xla", dtype=torch.bfloat16):
        got = tx.scan(fn, c0, xs)
        expected = scan_loop(fn, c0, xs)
    with torch.autocast("xla", dtype=torch.bfloat16, cache_enabled=False):
        uncached = scan_loop(fn, c0, xs)
    assert got[1].dtype == torch.bfloat16  # fn's ops ran under autocast
    got = [*got, *gradients(got, params)]
    expected = [*expected, *gradients(expected, params)]
    uncached = [*uncached, *gradients(uncached, params)]
    torch_xla.sync()
    for g, e, u in zip(got, expected, uncached):
        g, e, u = g.cpu(), e.cpu(), u.cpu()
        close(g, e, BF16)
        # The loop without the cast cache casts as scan does: the same numbers.
        close(g, u, SAME_ORDER)


def test_autocast_state_is_part_of_the_cache_key():
    lin = torch.nn.Linear(16, 16).to(DEV)
    xs = torch.randn(3, 2, 16, device=DEV)
    traces = []

    def step(c, x):
        if tx.is_placeholder(c):  # scan is tracing step
            traces.append(torch.is_autocast_enabled("xla"))
        y = lin(x)
        return c + y.float(), y

    init = torch.zeros(2, 16, device=DEV)
    with torch.no_grad():
        with torch.autocast("xla", dtype=torch.bfloat16):
            mixed = tx.scan(step, init, xs)
            mixed_loop = scan_loop(step, init, xs)
        plain = tx.scan(step, init, xs)
        plain_loop = scan_loop(step, init, xs)
        with torch.autocast("xla", dtype=torch.bfloat16):
            again = tx.scan(step, init, xs)
    torch_xla.sync()
    assert traces == [True, False]  # one trace per autocast state, each under its state
    assert mixed[1].dtype == again[1].dtype == torch.bfloat16 and plain[1].dtype == torch.float32
    for got, expected in [(mixed, mixed_loop), (plain, plain_loop), (again, mixed_loop)]:
        for g, e in zip(got, expected):
            close(g, e, SAME_ORDER)


def test_layer_stack_under_autocast_matches_the_module_list():
    torch.manual_seed(0)
    blocks = [DecoderBlock(32, 2).to(DEV) for _ in range(3)]
    reference = torch.nn.ModuleList(copy.deepcopy(blocks))
    stack = tx.LayerStack(blocks)
    x = torch.randn(2, 5, 32, device=DEV)
    with torch.autocast("xla", dtype=torch.bfloat16):
        out = stack(x)
        expected = x
        for layer in reference:
            expected = layer(expected)
    out.float().pow(2).mean().backward()
    expected.float().pow(2).mean().backward()
    torch_xla.sync()
    close(out, expected, BF16)
    for name, stacked in stack.stacked.named_parameters():
        per_layer = torch.stack([layer.get_parameter(name).grad for layer in reference])
        close(stacked.grad, per_layer, BF16)
