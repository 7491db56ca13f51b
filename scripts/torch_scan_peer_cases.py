"""The cases of `torch_scan_peer_suite.py`: torch's own test cases of its scan
operator, written as this project's code and run on the XLA device.

They follow the `scan` OpInfo of `torch.testing._internal.hop_db` and the scan
tests of `TestControlFlow` in pytorch's test/functorch/test_control_flow.py,
each group below named after the tests it follows (the suite's docstring lists
them): their functions and inputs, described in our own code, compared with
`for_loop` (torch_scan_peer_checks.py) on the same device. Each case is a
function of no arguments that raises on a mismatch, registered with `case`.
"""
from __future__ import annotations

import functools

import torch
from torch._higher_order_ops.scan import scan
from torch.utils._pytree import tree_leaves

from torch_scan_peer_checks import (
    DEVICE, FLAGS, add, both, case, check, check_equal, check_grads, div, for_loop, mul, scanner,
    tensor)


# hop_db's scan OpInfo: its one sample (init [2, 2] and xs [2, 2, 2] drawn
# between 0.1 and 2), its function (carry @ x + x, and a copy of the carry as
# the output), in the OpInfo's dtypes that XLA multiplies.
@case("hop_db_simple", dtype=(torch.float32, torch.float16, torch.int64))
def _(dtype):
    make = functools.partial(torch.testing.make_tensor, device=DEVICE, dtype=dtype, low=0.1,
                             high=2)
    check(lambda c, x: (c @ x + x, c.clone()), make(2, 2), make(2, 2, 2))


# test_scan_compile: running sums and products, integer sums (jax's examples),
# a carry computed apart from the output, and a non-associative division.
@case("compile", **FLAGS)
def _(reverse, autograd, compiled):
    x = tensor(3, 10, 2, grad=autograd)
    for op, fill in ((add, 0), (mul, 1)):
        init = tensor(10, 2, grad=autograd, fill=fill)
        check(both(op), init, x, reverse=reverse, compiled=compiled,
              params=(init, x) if autograd else None)
    check(both(add), torch.zeros(1, dtype=torch.int64, device=DEVICE),
          torch.arange(4, device=DEVICE), reverse=reverse, compiled=compiled)
    check(lambda c, x: (c * x, c + x), torch.ones(1, dtype=torch.int64, device=DEVICE),
          torch.arange(1, 5, device=DEVICE), reverse=reverse, compiled=compiled)
    x = torch.arange(5.0).to(DEVICE).requires_grad_(autograd)
    init = tensor(1, grad=autograd, fill=1)
    check(both(div), init, x, reverse=reverse, compiled=compiled,
          params=(init, x) if autograd else None)


# test_scan_dtype: carry and output in each dtype, and carry and xs of different dtypes.
@case("dtype", reverse=(False, True), compiled=(False, True),
      dtype=(torch.float16, torch.float32, torch.int32, torch.int64, torch.complex64))
def _(reverse, compiled, dtype):
    doubles = lambda c, x: (c + c, x + x)  # noqa: E731
    x = torch.randn(3, 10, 2).to(dtype).to(DEVICE)
    for init_dtype, xs in ((dtype, x), (torch.float32, x), (dtype, tensor(3, 10, 2))):
        check(doubles, torch.zeros(10, 2, dtype=init_dtype, device=DEVICE), xs,
              reverse=reverse, compiled=compiled)


# test_scan_dim: running sums and products along each dim of tensors of 2 to 5
# dims (torch draws the shapes at random; these are fixed).
@case("dim", **FLAGS)
def _(reverse, autograd, compiled):
    for shape, dim in (((4, 3), 1), ((2, 5, 3), 1), ((3, 2, 4, 2), 2), ((2, 3, 1, 2, 4), 4)):
        x = tensor(*shape, grad=autograd)
        init_shape = shape[:dim] + shape[dim + 1:]
        for op, fill in ((add, 0), (mul, 1)):
            init = tensor(*init_shape, grad=autograd, fill=fill)
            check(both(op), init, x, dim=dim, reverse=reverse, compiled=compiled,
                  params=(init, x) if autograd else None)


# test_scan_binary_operator: the S5 state-space model's operator on a tuple carry.
@case("binary_operator", **FLAGS)
def _(reverse, autograd, compiled):
    def s5(c, x):
        return x[0] * c[0], x[0] * c[1] + x[1]
    a, bu = tensor(20, grad=autograd), tensor(10, 20, grad=autograd)
    elements = (a.repeat(10, 1), bu)
    init = (tensor(1, 20, grad=autograd, fill=1), tensor(1, 20, grad=autograd, fill=0))
    check(both(s5), init, elements, reverse=reverse, compiled=compiled,
          params=(init, elements) if autograd else None)


# test_scan_tuple: tuple carries and xs, and an output that is not the carry.
@case("tuple", **FLAGS)
def _(reverse, autograd, compiled):
    x, y = tensor(3, 2, 2, grad=autograd), tensor(3, 2, 2, grad=autograd)
    init = (x[:1], y[:1])
    params = (init, (x, y)) if autograd else None
    check(both(lambda c, e: (c[0] + e[0], c[1] * e[1])), init, (x, y), reverse=reverse,
          compiled=compiled, params=params)
    check(lambda c, e: ((c[0] + e[0], c[1] * e[1]), c[1] * e[1]), init, (x, y),
          reverse=reverse, compiled=compiled, params=params)


def _pointwise_tree(c, x):
    return {"i": c["i"] * x["i"], "j": ([c["j"][0][0] * x["j"][0][0]],
                                        [{"o": c["j"][1][0]["o"] + x["j"][1][0]["o"]}])}


def _tree(x, y, z, rows):
    return {"i": x[rows], "j": ([y[rows]], [{"o": z[rows]}])}


# test_scan_complex_pytree: nested dicts and lists as carry and xs.
@case("complex_pytree", **FLAGS)
def _(reverse, autograd, compiled):
    x, y, z = (tensor(3, 2, 2, grad=autograd) for _ in range(3))
    init, xs = _tree(x, y, z, slice(0, 1)), _tree(x, y, z, slice(None))
    check(both(_pointwise_tree), init, xs, reverse=reverse, compiled=compiled,
          params=(init, xs) if autograd else None)


# test_scan_downstream_scan_matmul and _scan_scan_dim: a scan's results used by
# a matrix product, and by a second scan along another dim.
@case("downstream", **FLAGS)
def _(reverse, autograd, compiled):
    xs, init = tensor(3, 10, 2, grad=autograd), tensor(3, 2, grad=autograd)
    init2 = tensor(1, 10, 2, grad=autograd)
    params = (init, xs) if autograd else None
    for index in range(2):
        got = scanner(compiled)(both(add), init, xs, dim=1, reverse=reverse)[index]
        expected = for_loop(both(add), init, xs, 1, reverse)[index]
        weight = torch.ones(2, 5, device=DEVICE)
        check_equal(got @ weight, expected @ weight)
        if params:
            check_grads(got @ weight, expected @ weight, params)

    def chain(run):
        ys = run(both(add), init, xs, 1, reverse)[1].movedim(0, 1)
        return run(both(add), init2, ys, 0, reverse)
    got = chain(lambda *a: scanner(compiled)(*a[:3], dim=a[3], reverse=a[4]))
    expected = chain(for_loop)
    check_equal(got, expected)
    if autograd:
        check_grads(got, expected, (init, init2, xs))


# test_scan_non_pointwise: a matrix product with a weight the function creates.
@case("non_pointwise", **FLAGS)
def _(reverse, autograd, compiled):
    def fn(c, x):
        w = torch.arange(4, dtype=torch.float, device=c.device).view(2, 2)
        return c @ w + x @ w
    x, init = tensor(3, 10, 2, grad=autograd), tensor(10, 2, grad=autograd)
    check(both(fn), init, x, reverse=reverse, compiled=compiled,
          params=(init, x) if autograd else None)


# test_scan_init: a carry of another shape than the slices (a scalar, a larger
# tensor sliced, two steps' worth, a tiled carry sliced), and a scan along dim 2.
@case("init", **FLAGS)
def _(reverse, autograd, compiled):
    x = tensor(3, 5, 2, grad=autograd)
    xs = x[1:]
    run = functools.partial(check, reverse=reverse, compiled=compiled)
    init = tensor(1, grad=autograd, fill=1)
    run(lambda c, y: (c + 1.0, c + y), init, xs, params=(init, xs) if autograd else None)
    run(lambda c, y: (c + 1.0, c[:y.shape[0], :y.shape[1]] + y), tensor(7, 8, grad=autograd),
        xs)
    init = x[:2]
    run(both(add), init, xs, params=(init, xs) if autograd else None)
    init = torch.tile(init, (1, 2, 1))
    run(lambda c, y: (c + 1.0, c[:, :1, :] + y), init, xs,
        params=(init, xs) if autograd else None)
    x, init = tensor(3, 2, 2, grad=autograd), tensor(3, 2, grad=autograd, fill=0)
    run(both(add), init, x, dim=2, params=(init, x) if autograd else None)


# test_scan_init_pytree_complex: nested pytrees whose output, then carry, have
# another structure than the xs.
@case("init_pytree_complex", **FLAGS)
def _(reverse, autograd, compiled):
    def other_output(c, x):
        return (_pointwise_tree(c, x), (x["i"] * 2, {"o": c["i"] * x["i"], **_pointwise_tree(
            c, x)}))

    def other_carry(c, x):
        carry = {"i": c["i"] * x["i"], "j": (c["i"] * 2, [c["j"][1][0] * x["j"][0][0]],
                                             [{"o": c["j"][2][0]["o"] + x["j"][1][0]["o"]}])}
        return carry, (x["i"] * 2, {"o": c["i"] * x["i"] + c["j"][0][0]})
    x, y, z = (tensor(3, 2, 2, grad=autograd) for _ in range(3))
    first, rest = (slice(-1, None), slice(0, -1)) if reverse else (slice(0, 1), slice(1, None))
    init, xs = _tree(x, y, z, first), _tree(x, y, z, rest)
    params = (init, xs) if autograd else None
    run = functools.partial(check, reverse=reverse, compiled=compiled)
    run(both(_pointwise_tree), init, xs, params=params)
    run(other_output, init, xs)
    init = {"i": x[first], "j": (x[first], [y[first]], [{"o": z[first]}])}
    run(other_carry, init, xs, params=(init, xs) if autograd else None)


# test_scan_closure_RNN: torch.nn.RNN's recurrence with its weights captured,
# against the module itself.
@case("closure_RNN", autograd=(False, True), compiled=(False, True))
def _(autograd, compiled):
    rnn = torch.nn.RNN(input_size=5, hidden_size=7, batch_first=True).to(DEVICE)
    x, h = tensor(3, 10, 5, grad=autograd), tensor(3, 7, grad=autograd)
    w_ih, b_ih = rnn.weight_ih_l0.T.clone(), rnn.bias_ih_l0.clone()
    w_hh, b_hh = rnn.weight_hh_l0.T.clone(), rnn.bias_hh_l0.clone()
    if not autograd:
        w_ih, b_ih, w_hh, b_hh = (t.detach() for t in (w_ih, b_ih, w_hh, b_hh))

    def cell(c, y):
        new = torch.tanh(y @ w_ih + b_ih + c @ w_hh + b_hh)
        return new, new.clone()
    got = scanner(compiled)(cell, h, x, dim=1)
    out, state = rnn(x, h.unsqueeze(0))
    check_equal([got[0], got[1].movedim(0, 1)], [state[0], out])
    if autograd:
        weights = [rnn.weight_ih_l0, rnn.bias_ih_l0, rnn.weight_hh_l0, rnn.bias_hh_l0]
        check_grads(list(got), [state[0], out.movedim(1, 0)], [h, x, *weights])


# test_scan_closure_RNN_partial_autograd: two carries, two xs and four captured
# tensors, only some of which require grad (torch's fixed masks, and fixed
# stand-ins for its random ones).
MASKS = ("10111111", "00111111", "11011111", "11001111", "11110101", "11110000", "10000001",
         "00110001", "01101100", "10010110", "00000010")


@case("closure_RNN_partial_autograd", reverse=(False, True), compiled=(False, True),
      mask=MASKS)
def _(reverse, compiled, mask):
    grad = [flag == "1" for flag in mask]
    shapes = ((3, 10, 5), (3, 10, 5), (3, 7), (3, 7), (5, 7), (7,), (7, 7), (7,))
    x, x1, h, h1, w_ih, b_ih, w_hh, b_hh = (tensor(*s, grad=g) for s, g in zip(shapes, grad))

    def rnn(c, y):
        h_new = (torch.tanh(c[1] + 1 + c[0] @ w_hh + b_hh) + y[0] @ w_ih + y[1] @ w_ih + b_ih
                 + c[1])
        return (c[0] + 1, c[1] + 1), h_new
    params = [t for t, g in zip((x, x1, h, h1, w_ih, b_ih, w_hh, b_hh), grad) if g]
    check(rnn, (h, h1), (x, x1), dim=1, reverse=reverse, compiled=compiled,
          params=params or None)


def _no_grad_variants(w_ih, b_ih, w_hh, b_hh):
    """test_scan_closure_combine_fn_with_no_grad_*: parts of the step computed
    under torch.no_grad(), and which of the outputs' gradients torch checks."""
    def c1_no_grad(c, y):
        with torch.no_grad():
            c1 = c[0] + y
        return (c1, c[1] + y), torch.tanh(c[0] + c[1] + y)

    def ys_no_grad(c, y):
        with torch.no_grad():
            h_new = torch.tanh(c[0] + c[1] + y)
        return (c[0] + y, c[1] + y), h_new

    def inputs_partial(c, y):
        c_new = y @ w_ih + b_ih + c
        with torch.no_grad():
            extra = torch.tanh(c @ w_hh + b_hh)
        return c_new, c_new + 1 + extra

    def inputs_all(c, y, offset=None):
        c_new = c + y
        with torch.no_grad():
            c_extra, h_extra = y @ w_ih + b_ih, torch.tanh(c @ w_hh + b_hh)
        return c_new + c_extra, c_new + (c if offset is None else offset) + h_extra
    return {"c1_no_grad": c1_no_grad, "ys_no_grad": ys_no_grad,
            "additional_inputs_partial": inputs_partial, "additional_inputs_all": inputs_all,
            "carries_ys_same_grad": functools.partial(inputs_all, offset=1)}


@case("closure_no_grad", **FLAGS, variant=("c1_no_grad", "c1_no_grad_init_no_grad", "ys_no_grad",
                                           "additional_inputs_partial", "additional_inputs_all",
                                           "carries_ys_same_grad"))
def _(reverse, autograd, compiled, variant):
    x = tensor(3, 10, 7, grad=autograd)
    weights = [tensor(*s, grad=autograd) for s in ((7, 7), (7,), (7, 7), (7,))]
    fn = _no_grad_variants(*weights)[variant.replace("_init_no_grad", "")]
    run = functools.partial(check, dim=1, reverse=reverse, compiled=compiled)
    if variant.startswith("c1_no_grad"):
        h1 = tensor(3, 7, grad=autograd and variant == "c1_no_grad")
        h2 = tensor(3, 7, grad=autograd)
        got = run(fn, (h1, h2), x)
        if autograd:
            check_grads(tree_leaves(got)[1:], tree_leaves(for_loop(fn, (h1, h2), x, 1, reverse))[1:],
                        (x, h2))
    elif variant == "ys_no_grad":
        h1, h2 = tensor(3, 7, grad=autograd), tensor(3, 7, grad=autograd)
        got = run(fn, (h1, h2), x)
        if autograd:
            check_grads(got[0], for_loop(fn, (h1, h2), x, 1, reverse)[0], (x, h1, h2))
    else:
        h = tensor(3, 7, grad=autograd)
        got = run(fn, h, x)
        if autograd:
            params = (h, x, *weights[:2]) if variant.endswith("partial") else (h, x)
            check_grads(got[1], for_loop(fn, h, x, 1, reverse)[1], params)


# test_scan_closure_nested: a step with captured weights, and two scans chained
# (along dim 1, then along dim 0 of the first one's outputs), one of them
# capturing both scans' weights.
@case("closure_nested", **FLAGS)
def _(reverse, autograd, compiled):
    def step(w, b):
        return lambda c, y: (y @ w + b, torch.tanh(y @ w + b + c))

    x, h = tensor(3, 20, 5, grad=autograd), tensor(3, 7, grad=autograd)
    w, b = tensor(5, 7, grad=autograd), tensor(7, grad=autograd)
    check(step(w, b), h, x, dim=1, reverse=reverse, compiled=compiled,
          params=(h, x, w, b) if autograd else None)

    def chain(run, f1, f2, xs, h1, h2):
        return run(f2, h2, run(f1, h1, xs, 1, reverse)[1], 0, reverse)
    ours = lambda fn, init, xs, dim, rev: scanner(compiled)(fn, init, xs, dim=dim, reverse=rev)  # noqa: E731
    for sizes, coupled in (((5, 7, 3), False), ((3, 3, 3), True)):
        x1 = tensor(3, 20, sizes[0], grad=autograd)
        h1, h2 = tensor(3, sizes[1], grad=autograd), tensor(3, sizes[2], grad=autograd)
        w1, b1 = tensor(sizes[0], sizes[1], grad=autograd), tensor(sizes[1], grad=autograd)
        w2, b2 = tensor(sizes[1], sizes[2], grad=autograd), tensor(sizes[2], grad=autograd)
        f2 = ((lambda c, y: (y @ w2 + b2 * b1 + y @ w1, torch.tanh(y @ w2 + b2 * b1 + y @ w1 + c)))
              if coupled else step(w2, b2))
        got = chain(ours, step(w1, b1), f2, x1, h1, h2)
        expected = chain(for_loop, step(w1, b1), f2, x1, h1, h2)
        check_equal(got, expected)
        if autograd:
            check_grads(got, expected, (h1, h2, x1, w1, b1) + ((w2, b2) if coupled else ()))


# test_scan_y_less_ndim_then_dim: an output of fewer dims than the scanned dim.
@case("y_less_ndim_than_dim")
def _():
    check(lambda c, x: (c @ x, (c @ x).sum()), tensor(4, 3), tensor(3, 3, 2), dim=2)


# test_scan_multiple_layers_gradient: layers of Linear modules stepped over a
# sequence, their states carried as a list, or as one tensor written in place
# by slices, against the same layers in a for loop (torch compares each model
# compiled with inductor and not; here each scan with the loop).
@case("multiple_layers_gradient", layers=(1, 2, 3), carried=("list", "tensor"))
def _(layers, carried):
    features = 10
    linears = torch.nn.ModuleList(torch.nn.Linear(2 * features, features)
                                  for _ in range(layers)).to(DEVICE)

    def layer_step(states, x):
        states = list(states)
        for i, linear in enumerate(linears):
            states[i] = states[i] + linear(torch.cat((states[i], x), dim=-1))
            x = states[i]
        return states, x

    def as_list(states, x):
        states, out = layer_step(states, x)
        return [s.clone() for s in states], out.clone()

    def as_tensor(stacked, x):
        states, out = layer_step(stacked.unbind(1), x)
        stacked = stacked.clone()
        for i, state in enumerate(states):
            stacked[:, i, :] = state
        return stacked.clone(), out.clone()
    inputs = tensor(2, 5, features, grad=True)
    initial = [tensor(2, features, grad=True, fill=0) for _ in range(layers)]
    fn, init = (as_list, initial) if carried == "list" else (as_tensor, torch.stack(initial, 1))
    params = [inputs, *initial, *linears.parameters()]
    check(fn, init, inputs, dim=1, params=params)


# test_scan_compile_cnt: which calls of a compiled scan recompile when sizes,
# the scanned dim or the direction change, with automatic dynamic shapes.
@case("compile_cnt", reverse=(False, True))
def _(reverse):
    from torch._dynamo.testing import CompileCounter
    counter = CompileCounter()
    calls = [((3, 2, 5), (3, 5), 1, reverse, 1), ((3, 20, 5), (3, 5), 1, reverse, 2),
             ((3, 40, 5), (3, 5), 1, reverse, 2), ((3, 40, 5), (3, 40), 2, reverse, 3),
             ((3, 40, 20), (3, 40), 2, reverse, 4), ((3, 40, 40), (3, 40), 2, reverse, 4),
             ((3, 60, 40), (3, 40), 1, reverse, 5), ((3, 60, 40), (3, 40), 1, not reverse, 6),
             ((3, 60, 40), (3, 40), 1, not reverse, 6), ((3, 120, 80), (3, 80), 1, reverse, 6)]
    with torch._dynamo.config.patch(automatic_dynamic_shapes=True):
        for shape, init_shape, dim, direction, frames in calls:
            x, init = tensor(*shape), tensor(*init_shape)
            got = torch.compile(scan, backend=counter)(both(add), init, x, dim=dim,
                                                       reverse=direction)
            check_equal(got, for_loop(both(add), init, x, dim, direction))
            assert counter.frame_count == frames, (
                f"{counter.frame_count} compilations after the call on {shape} along dim {dim}, "
                f"torch's test expects {frames}")


# The error cases of test_scan_wrong_pytree, _float_output, _init_scanned_0,
# _init_non_tensor, _init_wrong_shape, _init_wrong_pytree_*, _one_return,
# _simple_graph_wrong_dtype, _input_mutation, _input_carry_alias and
# _input_output_alias: each must raise on the device as it does on the CPU
# (the same exception class).
def _error_calls(device):
    x = torch.randn(3, 1, 2, device=device)
    y = torch.randn(3, 2, 2, device=device)
    z = torch.randn(3, 2, 2, device=device)
    tree = {"i": y, "j": ([z], [{"o": y.clone()}])}
    tree_init = {"i": y[:1], "j": ([z[:1]], [{"o": y[:1]}])}

    def wrong_tree(c, e):
        out = {"i": c["i"] * e["j"][0][0], "k": torch.tensor(0.0, device=device),
               "j": ([c["j"][1][0]["o"].clone()], [{"o": torch.sin(c["i"])}])}
        return out, out

    def mutates(c, e):
        c.add_(1)
        return c + e, c + e + 2
    pair, pair_init = (y, z), (torch.randn(2, 2, device=device), torch.randn(2, 2, device=device))
    return {
        "wrong_pytree": (wrong_tree, tree_init, tree, 0),
        "float_output": (lambda c, e: (0.0, c + e), y[:1], y, 0),
        "init_scanned_0": (both(add), x.narrow(1, 0, 1), x.narrow(1, 1, 0), 1),
        "init_non_tensor": (both(add), 1.0, x, 1),
        "init_wrong_shape": (both(add), torch.randn(1, 2, device=device), x, 1),
        "init_longer_carry": (lambda c, e: (c[0] + 1.0, e + 1.0), (x[:, :1], x[:, :1]), x, 1),
        "init_shorter_carry": (lambda c, e: ((c + 1, c + 2), c + 3), x[:, :1], x, 1),
        "carry_shape": (lambda c, e: (c[0, :], c + 3), x[:, :1], x, 1),
        "one_return": (lambda c, e: c + 3, x[:, :1], x, 1),
        "wrong_dtype": (lambda c, e: (torch.ones_like(c + e, dtype=torch.int64), c + e),
                        torch.randn(1, 10, 2, device=device), torch.randn(3, 10, 2, device=device),
                        0),
        "input_mutation": (mutates, torch.randn(2, 2, device=device), y, 0),
        "input_carry_alias": (lambda c, e: ((c[0], c[1] + e[1]), (c[1] + e[1] + 1, c[1] + 2)),
                              pair_init, pair, 0),
        "input_output_alias": (lambda c, e: ((c[0] + 1, c[1] + e[1]), (c[1], c[1] + e[1] + 2)),
                               pair_init, pair, 0),
    }


def _raised(device, name):
    fn, init, xs, dim = _error_calls(device)[name]
    torch._dynamo.reset()
    try:
        scan(fn, init, xs, dim=dim)
    except Exception as error:  # the class raised is what the case compares
        return type(error)
    return None


@case("errors", call=tuple(_error_calls("cpu")))
def _(call):
    expected, got = _raised("cpu", call), _raised(DEVICE, call)
    assert expected is not None, f"{call}: torch raises nothing on the CPU"
    assert got is expected, f"{call}: raised {got and got.__name__}, on the CPU {expected.__name__}"
