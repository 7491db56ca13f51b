"""scan's StepCotangents (scan/cotangents.py): the cotangent each step gives
its stacked ys, against the gradients `retain_grad()` gets in a for loop."""
import re

import pytest
import torch
import torch_xla

import torch_xla_ext as tx
from torch_xla_ext.diagnostics import NestedScanWarning
from torch_xla_ext.scan import StepCotangents
from test_scan import DEV, randn
from tolerances import THROUGH_LAYERS, close


def step(weight, carry, x):
    # `mixed` is used after it is returned, as attention weights are, and
    # the step returns its carry input as a y, as a layer's hidden state.
    mixed = torch.softmax(carry @ weight, -1)
    return torch.tanh(2 * mixed + x + carry), {"mixed": mixed, "entering": carry,
                                               "steps": torch.ones((), dtype=torch.int64, device=DEV)}


def loss_of(carry, ys):
    # One y has a use of its own as well.
    return carry.sum() + 0.5 * ys["mixed"][1].sum()


def for_loop(weight, init, xs):
    """The step's ys' gradients when each is a value of the loop, and the weight's."""
    carry, values = init, []
    for x in xs:
        carry, y = step(weight, carry, x)
        for name in ("mixed", "entering"):
            y[name].retain_grad()
        values.append(y)
    stacked = {name: torch.stack([y[name] for y in values]) for name in ("mixed", "entering")}
    loss_of(carry, stacked).backward()
    return ({name: torch.stack([y[name].grad for y in values]) for name in ("mixed", "entering")},
            weight.grad)


@pytest.mark.parametrize("reverse, unroll", [(False, 1), (True, 2)])
def test_the_backward_gives_each_steps_cotangent_of_its_ys_beyond_their_own_uses(reverse,
                                                                                  unroll):
    torch.manual_seed(0)
    weight = randn(4, 4, grad=True)
    init, xs = randn(2, 4, grad=True), randn(3, 2, 4)
    if reverse:  # the for loop over the reversed steps, its ys in xs' order
        expected, expected_weight = for_loop(weight, init, xs.flip(0))
        expected = {name: grad.flip(0) for name, grad in expected.items()}
    else:
        expected, expected_weight = for_loop(weight, init, xs)
    weight.grad = None
    received = []
    asked = StepCotangents(wanted=lambda: True, receive=received.append)
    carry, ys = tx.scan(lambda c, x: step(weight, c, x), init, xs, reverse=reverse,
                        unroll=unroll, step_cotangents=asked)
    loss_of(carry, ys).backward()
    (cotangents,) = received
    assert cotangents["steps"] is None  # not floating
    close(weight.grad, expected_weight, THROUGH_LAYERS)
    close(cotangents["entering"], expected["entering"], THROUGH_LAYERS)
    # What the loss gave the slice itself is not among them.
    own = torch.zeros(3, 2, 4, device=DEV)
    own[1] = 0.5
    close(cotangents["mixed"] + own, expected["mixed"], THROUGH_LAYERS)


def test_unwanted_the_backward_is_the_one_without_them():
    torch.manual_seed(0)
    weight = randn(4, 4, grad=True)
    init, xs = randn(2, 4), randn(3, 2, 4)
    received = []
    asked = StepCotangents(wanted=lambda: False, receive=received.append)
    carry, ys = tx.scan(lambda c, x: step(weight, c, x), init, xs, step_cotangents=asked)
    loss_of(carry, ys).backward()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([weight.grad])
    assert received == [] and "scan_backward" in hlo and "scan_backward_tapped" not in hlo
    expected = weight.grad.clone()
    weight.grad = None
    carry, ys = tx.scan(lambda c, x: step(weight, c, x), init, xs)
    loss_of(carry, ys).backward()
    close(weight.grad, expected, THROUGH_LAYERS)


def test_a_nested_scan_takes_none_and_says_so():
    torch.manual_seed(0)
    weight = randn(4, 4, grad=True)
    init, xs = randn(2, 4), randn(2, 3, 2, 4)
    received = []
    asked = StepCotangents(wanted=lambda: True, receive=received.append)

    def outer(carry, x):
        return tx.scan(lambda c, row: step(weight, c, row), carry, x,
                       step_cotangents=asked)[0], None

    with pytest.warns(NestedScanWarning, match="was given step_cotangents, which has no "
                                               "effect in a nested scan"):
        carry, _ = tx.scan(outer, init, xs)
    carry.sum().backward()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([weight.grad])
    assert received == [] and len(re.findall(r"\bwhile\(", hlo)) == 4
