"""Layers that hand the next layer a value besides their hidden state (the
forward passes what a layer returned on to the next layer's call): the plan
makes it part of the scan's carry (`Leaf("handed")`), the run's first layer
gets it from the forward, the forward gets the last layer's, and the
results and gradients are the loop's."""

import pytest
import torch
from torch import nn

from layer_calls import HIDDEN, Block, converted, forward_with_warnings
from per_layer import per_layer_grads
from tolerances import TRAINING, close, close_by_name
from torch_xla_ext.layer_stack.planner import Leaf, plan_calls
from torch_xla_ext.layer_stack.dry_run import record_calls


class Handing(Block):
    """Returns, besides its hidden state, a value the next block adds to its own."""

    def forward(self, x, extra=None, scale=None):
        x = self.linear(self.norm(x))
        if extra is not None:
            x = x + extra
        if scale is not None:
            x = x * scale
        return x, torch.tanh(x) * 0.5


class Loop(nn.Module):
    """Hands each block what the one before returned besides its hidden
    state; the first block gets `first` (None, or a tensor the forward
    makes); block i gets `scales[i]`, if given."""

    def __init__(self, layers: int = 3, first: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Handing() for _ in range(layers))
        self.start = nn.Parameter(torch.randn(HIDDEN)) if first else None
        self.scales = None

    def forward(self, x):
        extra = None if self.start is None else self.start * x
        for index, block in enumerate(self.blocks):
            x, extra = block(x, extra, None if self.scales is None else self.scales[index])
        return x * extra  # the forward uses the last block's handed value


def test_the_handed_value_is_carried_with_the_hidden_state(device):
    reference, model = converted(Loop(), device)
    x = torch.randn(2, HIDDEN, device=device)
    record = record_calls(model, {"blocks": model.blocks}, (x,), {})
    plan = plan_calls(model.blocks, record.calls["blocks"], record)
    (run,) = plan.runs
    assert (run.start, run.stop, run.how) == (0, 3, "scan")
    assert run.leaves == ((Leaf("carried"), Leaf("handed", output=1), Leaf("shared")),)
    assert run.handed_outputs() == {1}
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 1 and not one_by_one
    expected = reference(x)
    close(output, expected, TRAINING)
    output.sum().backward()
    expected.sum().backward()
    close_by_name(per_layer_grads(model),
                  {name: param.grad for name, param in reference.named_parameters()}, TRAINING)


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


class Producing(Handing):
    """Another structure, which makes the value without taking one."""

    def __init__(self):
        super().__init__()
        self.other = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return super().forward(self.other(x))


class ProducersThenTakers(nn.Module):
    """Two blocks that make a value, then two that each take the one before's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Producing(), Producing(), Handing(), Handing()])

    def forward(self, x):
        extra = None
        for index, block in enumerate(self.blocks):
            x, extra = block(x) if index < 2 else block(x, extra)
        return x


def test_a_value_a_scan_makes_for_the_next_run_is_its_last_layers(device):
    reference, model = converted(ProducersThenTakers(), device)
    x = torch.randn(2, HIDDEN, device=device)
    record = record_calls(model, {"blocks": model.blocks}, (x,), {})
    plan = plan_calls(model.blocks, record.calls["blocks"], record)
    assert [(run.start, run.stop, run.how) for run in plan.runs] == [(0, 2, "scan"),
                                                                      (2, 4, "scan")]
    # The first scan gives the value layer 2 gets from layer 1 (what it stacks per layer).
    assert plan.runs[0].kept == ((1,),) and plan.runs[1].handed_outputs() == {1}
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 2 and not one_by_one
    close(output, reference(x), TRAINING)


def test_a_scan_that_cannot_run_hands_the_values_on_layer_by_layer(device):
    # Scales of two shapes, one per layer, cannot be stacked for the scan,
    # which would have run at the last call: the layers called until then
    # run one by one on what each returned, not on the stand-ins they got.
    reference, model = converted(Loop(), device)
    reference.scales = model.scales = [torch.rand(size, device=device) + 0.5
                                       for size in (HIDDEN, 1, HIDDEN)]
    x = torch.randn(2, HIDDEN, device=device)
    record = record_calls(model, {"blocks": model.blocks}, (x,), {})
    (run,) = plan_calls(model.blocks, record.calls["blocks"], record).runs
    assert run.how == "scan" and run.trigger == 2
    output, _, one_by_one = forward_with_warnings(model, x)
    assert len(one_by_one) == 1 and "differs between the layers" in one_by_one[0]
    close(output, reference(x), TRAINING)
