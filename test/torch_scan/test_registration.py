"""torch's scan operator on XLA tensors, registered: it runs as torch_xla_ext's
scan (one While loop forward, one backward), gives the for loop's values and
gradients, and leaves traced calls, unregistered calls and code that does not
call it as torch has them."""

import pytest
import torch
import torch_xla
from torch._higher_order_ops.scan import scan as torch_scan
from torch.utils._pytree import tree_leaves

import torch_xla_ext as tx
from torch_xla_ext.torch_scan import TorchScanWarning
from reference import scan_loop
from tolerances import ACCUMULATED, BF16, SAME_OPS, SAME_ORDER, close

DEV = torch_xla.device()


def randn(*shape, grad=False):
    return torch.randn(*shape).to(DEV).requires_grad_(grad)


def while_loops(tensors) -> int:
    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors)).count(" while(")


def gradients(result, params):
    outputs = [t for t in tree_leaves(result) if t is not None and t.requires_grad]
    return torch.autograd.grad([t.float().sum() for t in outputs], params, allow_unused=True)


def rnn_call():
    """A recurrence over xs [5, 2, 4] with a weight and a bias captured, its
    init not requiring grad (the case torch 2.9's own backward gets wrong)."""
    weight, bias = randn(4, 4, grad=True), randn(4, grad=True)
    init, xs = randn(2, 4), randn(5, 2, 4, grad=True)

    def step(c, x):
        new = torch.tanh(c @ weight + x + bias)
        return new, new * 2
    return step, init, xs, [weight, bias, xs]


def check_against_the_loop(step, init, xs, params, reverse=False, dim=0, tolerance=SAME_OPS):
    got = torch_scan(step, init, xs, reverse=reverse, dim=dim)
    moved = torch.utils._pytree.tree_map(lambda x: x.movedim(dim, 0), xs)
    expected = scan_loop(step, init, moved, reverse=reverse)
    close(got, expected, tolerance, "values")
    close(gradients(got, params), gradients(expected, params), ACCUMULATED, "gradients")


def import_scenario():
    """What importing the package and its torch_scan does to torch's operator."""
    from torch._C import DispatchKey
    from torch._higher_order_ops.scan import scan_op
    keys = dict(scan_op.py_kernels)
    mask = scan_op.non_fallthrough_keys.raw_repr()
    import torch_xla_ext as tx
    import torch_xla_ext.torch_scan  # noqa: F401
    assert dict(scan_op.py_kernels) == keys and DispatchKey.AutogradXLA not in keys
    assert scan_op.non_fallthrough_keys.raw_repr() == mask
    with tx.register_torch_scan():
        assert DispatchKey.AutogradXLA in scan_op.py_kernels
    print("unchanged by imports")


def test_importing_changes_nothing_of_torchs_operator(run_isolated):
    result = run_isolated(import_scenario)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "unchanged by imports" in result.stdout


@pytest.fixture
def registered():
    with tx.register_torch_scan() as registration:
        yield registration


def test_unregistered_the_operator_runs_unrolled_and_registered_as_one_loop():
    step, init, xs, _ = rnn_call()
    assert while_loops(torch_scan(step, init, xs)) == 0
    with tx.register_torch_scan():
        assert while_loops(torch_scan(step, init, xs)) == 1
    assert while_loops(torch_scan(step, init, xs)) == 0


def test_forward_and_backward_are_one_while_loop_each(registered):
    step, init, xs, params = rnn_call()
    carry, ys = torch_scan(step, init, xs)
    assert while_loops([carry, ys]) == 1
    grads = torch.autograd.grad((carry.sum() + ys.sum()), params)
    assert while_loops(grads) == 2  # the forward loop, then the backward loop
    with torch.no_grad():
        assert while_loops(torch_scan(step, init, xs)) == 1


@pytest.mark.parametrize("reverse", [False, True])
def test_captured_tensors_values_and_gradients_equal_the_loop(registered, reverse):
    check_against_the_loop(*rnn_call(), reverse=reverse)


def test_pytrees_and_another_dim_equal_the_loop(registered):
    counts = torch.zeros((), dtype=torch.int64, device=DEV)
    init = {"h": randn(2, 3, grad=True), "n": counts}
    xs = (randn(2, 4, 3, grad=True), {"scale": randn(2, 4, 1, grad=True)})

    def step(c, x):
        h = torch.sin(c["h"] * x[1]["scale"] + x[0])
        return {"h": h, "n": c["n"] + 1}, {"twice": h * 2, "sum": h.sum()}
    check_against_the_loop(step, init, xs, [init["h"], xs[0], xs[1]["scale"]], dim=1)


def test_additional_inputs_of_a_direct_call_get_gradients(registered):
    weight, init, xs = randn(4, 4, grad=True), randn(2, 4, grad=True), randn(5, 2, 4)

    def body(c, x, w):
        new = torch.tanh(c @ w + x)
        return [new, new.sum(-1)]
    carry, ys = torch.ops.higher_order.scan(body, [init], [xs], (weight,))
    assert while_loops([carry, ys]) == 1
    expected = scan_loop(lambda c, x: tuple(body(c, x, weight)), init, xs)
    close((carry, ys), expected, SAME_OPS, "values")
    close(gradients((carry, ys), [weight, init]), gradients(expected, [weight, init]),
          ACCUMULATED, "gradients")


def test_the_registration_policy_decides_what_the_forward_loop_keeps():
    step, init, xs, params = rnn_call()
    kept, results = {}, {}
    for policy in ("save_everything", "save_nothing"):
        with tx.register_torch_scan(policy):
            carry, ys = torch_scan(step, init, xs)
            results[policy] = gradients((carry, ys), params)
        # What the forward loop returns: the carry, ys, and the activations it stacks.
        hlo = torch_xla._XLAC._get_xla_tensors_hlo(list(results[policy]))
        kept[policy] = hlo.count("f32[5,2,4]")
    # The weights' gradients sum over the steps: ACCUMULATED, as elsewhere.
    close(results["save_nothing"], results["save_everything"], ACCUMULATED, "gradients")
    assert kept["save_nothing"] < kept["save_everything"], kept


def test_unroll_runs_more_steps_per_iteration():
    step, init, xs, _ = rnn_call()
    hlos = {}
    for unroll in (1, 5):
        with tx.register_torch_scan(unroll=unroll):
            result = torch_scan(step, init, xs)
            hlos[unroll] = torch_xla._XLAC._get_xla_tensors_hlo(list(result))
        close(result, scan_loop(step, init, xs), SAME_OPS)
    assert hlos[1].count("tanh(") == 1 and hlos[5].count("tanh(") == 5


def test_autocast_matches_the_loop(registered):
    linear = torch.nn.Linear(16, 16).to(DEV)
    init, xs = randn(2, 16, grad=True), randn(4, 2, 16, grad=True)
    params = [init, xs, linear.weight, linear.bias]

    def step(c, x):
        h = torch.tanh(linear(c))
        return h.float() + x, h
    with torch.autocast("xla", dtype=torch.bfloat16):
        got = torch_scan(step, init, xs)
        expected = scan_loop(step, init, xs)
        assert while_loops(got) == 1 and got[1].dtype == torch.bfloat16
    with torch.autocast("xla", dtype=torch.bfloat16, cache_enabled=False):
        uncached = scan_loop(step, init, xs)
    for g, e, u in zip([*got, *gradients(got, params)], [*expected, *gradients(expected, params)],
                       [*uncached, *gradients(uncached, params)]):
        close(g, e, BF16)
        close(g, u, SAME_ORDER)  # the loop casting at each step, as scan does


def test_under_inference_mode_it_runs_torchs_kernel_and_warns(registered):
    step, init, xs, _ = rnn_call()
    with torch.inference_mode(), pytest.warns(TorchScanWarning, match="torch.no_grad"):
        carry, ys = torch_scan(lambda c, x: (c + x, c * 2), init.detach(), xs.detach())
        assert while_loops([carry, ys]) == 0


def test_traced_calls_keep_the_operator_a_node_of_the_graph(registered):
    from torch.fx.experimental.proxy_tensor import make_fx
    step, init, xs, _ = rnn_call()
    graph = make_fx(lambda i, x: torch_scan(step, i, x))(init, xs)
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert torch.ops.higher_order.scan in targets

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake_init, fake_xs = mode.from_tensor(init), mode.from_tensor(xs)
    carry, ys = torch.ops.higher_order.scan(lambda c, x: [c + x, c * 2], [fake_init], [fake_xs], ())
    assert isinstance(carry, FakeTensor) and ys.shape == (5, 2, 4)


def test_code_that_does_not_call_the_operator_is_unchanged():
    step, init, xs, _ = rnn_call()

    def hlo():
        carry, ys = scan_loop(step, init, xs)
        return torch_xla._XLAC._get_xla_tensors_hlo([carry, ys])
    before = hlo()
    with tx.register_torch_scan():
        assert hlo() == before


def test_a_registration_restores_the_state_before_it():
    step, init, xs, _ = rnn_call()
    outer = tx.register_torch_scan("save_nothing")
    try:
        with tx.register_torch_scan("save_dots", unroll=2) as inner:
            assert inner.options.unroll == 2
        assert while_loops(torch_scan(step, init, xs)) == 1  # the outer registration's
    finally:
        tx.unregister_torch_scan()
    assert outer.options.partition_fn is tx.policies.save_nothing
    assert while_loops(torch_scan(step, init, xs)) == 0


@pytest.mark.parametrize("arguments, error, message", [
    (("no_such_policy",), ValueError, "unknown policy 'no_such_policy'"),
    ((3,), TypeError, "partition_fn must be"),
    ((tx.policies.save_everything, 0), ValueError, "unroll must be 1 or more"),
])
def test_bad_arguments_are_refused_and_change_nothing(arguments, error, message):
    partition_fn, *unroll = arguments
    with pytest.raises(error, match=message):
        tx.register_torch_scan(partition_fn, **({"unroll": unroll[0]} if unroll else {}))
    step, init, xs, _ = rnn_call()
    assert while_loops(torch_scan(step, init, xs)) == 0


def test_a_direct_call_inside_scans_fn_runs_as_a_loop_nested_in_the_step(registered):
    def outer(c, x):
        inner = torch.ops.higher_order.scan(lambda a, y: [a + y, a * 2], [c], [x], ())
        return inner[0], inner[1].sum(0)
    init, xs = torch.zeros(3, device=DEV), randn(4, 2, 3)
    carry, ys = tx.scan(outer, init, xs)
    close(carry, xs.sum((0, 1)), SAME_OPS)
    assert while_loops([carry, ys]) == 2  # the outer loop, and the operator's in its body


def test_torchs_scan_function_inside_scans_fn_is_refused_by_dynamo(registered):
    # torch's scan() compiles itself with Dynamo, which reads the storage of
    # the placeholders scan traces fn with; the operator called directly runs.
    def outer(c, x):
        return torch_scan(lambda a, y: (a + y, a * 2), c, x)[0], None
    with pytest.raises(Exception, match="placeholder"):
        tx.scan(outer, torch.zeros(3, device=DEV), randn(4, 2, 3))
