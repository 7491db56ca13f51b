"""Layers that hand the next layer a value besides their hidden state (the
forward passes what a layer returned on to the next layer's call): the plan
makes it part of the scan's carry (`Leaf("handed")`), the run's first layer
gets it from the forward, the forward gets the last layer's, and the
results and gradients are the loop's."""
import copy

import pytest
import torch
import torch_xla
from torch import nn

from layer_calls import HIDDEN, Block, forward_with_warnings
from per_layer import per_layer_grads
from tolerances import TRAINING, close
from torch_xla_ext.layer_stack import OwnerPlans, StackedList, drive_loops
from torch_xla_ext.layer_stack.call_plan import Leaf, plan_calls
from torch_xla_ext.layer_stack.dry_run import record_calls


class Handing(Block):
    """Returns, besides its hidden state, a value the next block adds to its own."""

    def forward(self, x, extra=None):
        x = self.linear(self.norm(x))
        if extra is not None:
            x = x + extra
        return x, torch.tanh(x) * 0.5


class Loop(nn.Module):
    """Hands each block what the one before returned besides its hidden
    state; the first block gets `first` (None, or a tensor the forward makes)."""

    def __init__(self, layers: int = 3, first: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Handing() for _ in range(layers))
        self.start = nn.Parameter(torch.randn(HIDDEN)) if first else None

    def forward(self, x):
        extra = None if self.start is None else self.start * x
        for block in self.blocks:
            x, extra = block(x, extra)
        return x * extra  # the forward uses the last block's handed value


@pytest.fixture(scope="module")
def device():
    return torch_xla.device()


def converted(model: Loop, device) -> tuple[Loop, Loop]:
    stacked = copy.deepcopy(model)
    stacked.blocks = StackedList(stacked.blocks)
    drive_loops(stacked, ("blocks",), OwnerPlans().start)
    return model.to(device), stacked.to(device)


def test_the_handed_value_is_carried_with_the_hidden_state(device):
    reference, model = converted(Loop(), device)
    x = torch.randn(2, HIDDEN, device=device)
    record = record_calls(model, {"blocks": model.blocks}, (x,), {})
    plan = plan_calls(model.blocks, record.calls["blocks"], record)
    (run,) = plan.runs
    assert (run.start, run.stop, run.how) == (0, 3, "scan")
    assert run.leaves == ((Leaf("carried"), Leaf("handed", output=1)),)
    assert run.handed_outputs() == {1}
    for step in range(2):  # the second call runs by the plan of the first
        output, loops, one_by_one = forward_with_warnings(model, x + step)
        assert loops == 1 and not one_by_one
        expected = reference(x + step)
        close(output, expected, TRAINING)
    output.sum().backward()
    expected.sum().backward()
    grads = per_layer_grads(model)
    for name, param in reference.named_parameters():
        close(grads[name], param.grad, TRAINING, name)


def test_a_first_layer_given_none_runs_as_itself_and_the_rest_as_one_scan(device):
    reference, model = converted(Loop(layers=4, first=False), device)
    x = torch.randn(2, HIDDEN, device=device)
    record = record_calls(model, {"blocks": model.blocks}, (x,), {})
    plan = plan_calls(model.blocks, record.calls["blocks"], record)
    assert [(run.start, run.stop, run.how) for run in plan.runs] == [
        (0, 1, "itself"), (1, 4, "scan")]
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 1 and not one_by_one
    close(output, reference(x), TRAINING)
