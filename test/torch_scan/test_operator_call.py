"""`scan`'s contract as one call of torch's scan operator (what a converted
model's runs are under torch.export): the rehearsal on fakes decides the
call's form (read-only carries as additional inputs, a carry written in
place as a copy the body writes, operands given once), or says why the
operator cannot take the step; the call gives the for loop's results."""
import torch

from tolerances import SAME_OPS, close
from torch_xla_ext.torch_scan.operator_call import rehearse, scan_through_operator


def loop(step, init, xs):
    carry, ys = init, []
    for index in range(xs["w"].shape[0]):
        carry, y = step(carry, {name: value[index] for name, value in xs.items()})
        ys.append(y)
    return carry, ys


def step(carry, x):
    """A hidden state, a read-only bias given twice, and a state written in place."""
    hidden, (bias, same_bias), state = carry
    hidden = torch.tanh(hidden @ x["w"] + bias + same_bias)
    state.add_(hidden.sum())
    return (hidden, (bias, same_bias), state), {"out": hidden * 2, "none": None}


def test_the_rehearsal_decides_the_calls_form_and_the_call_gives_the_loops_results():
    torch.manual_seed(0)
    bias = torch.randn(4)
    init = (torch.randn(2, 4), (bias, bias), torch.zeros(()))
    xs = {"w": torch.randn(3, 4, 4)}
    rehearsed = rehearse(step, init, xs)
    assert (rehearsed.read_only, rehearsed.written, rehearsed.nones) == ((1, 2), (3,), (1,))
    fresh = (init[0], init[1], torch.zeros(()))
    (hidden, _, state), ys = scan_through_operator(step, fresh, xs, rehearsed)
    (expected_hidden, _, expected_state), expected_ys = loop(step, init, xs)
    close((hidden, state, ys["out"]), (expected_hidden, expected_state,
                                       torch.stack([y["out"] for y in expected_ys])), SAME_OPS)
    assert ys["none"] is None
    assert torch.equal(fresh[2], torch.zeros(()))  # the operator's input is not written


def test_the_rehearsal_says_why_the_operator_cannot_take_a_step():
    init, xs = torch.zeros(2, 4), {"w": torch.randn(3, 4, 4)}
    writes_its_slice = lambda c, x: (c + x["w"].add_(1).sum(), c)  # noqa: E731
    grows = lambda c, x: (torch.cat([c, c]), c)  # noqa: E731
    counts = lambda c, x: (c + 1, 3)  # noqa: E731
    assert "slices of xs leaves [0] in place" in rehearse(writes_its_slice, init, xs).reason
    assert "keeps a carry's shape and dtype" in rehearse(grows, init, xs).reason
    assert "output leaf 0 is a int" in rehearse(counts, init, xs).reason
