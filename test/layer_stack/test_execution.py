"""A forward's calls of its stacked layers run as their plan says
(layer_stack.execution), through the hooks on the owner (owner_loops.drive_loops)
and its plans (plans.OwnerPlans): the loop's results from one scan, the
layers in between given stand-ins, and a call that is not what the plan of
its kind of call says raises rather than compute something else."""

import pytest
import torch
from torch import nn

from layer_calls import HIDDEN, Block, converted, forward_with_warnings
from tolerances import TRAINING, close
from torch_xla_ext.placeholders import is_placeholder


class Loop(nn.Module):
    """Calls its blocks in `order`, each on what the one before returned (or
    doubled, while `doubles[0]`), with `arguments[i]` as block i's keywords;
    keeps the hidden states it sees in `seen`."""

    def __init__(self, layers=3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.order, self.doubles = list(range(layers)), [False]
        self.arguments = [{} for _ in range(layers)]
        self.seen = []

    def forward(self, x):
        self.seen.clear()
        blocks = list(self.blocks)
        for index in self.order:
            x = blocks[index](x, **self.arguments[index])
            self.seen.append(x)
            if self.doubles[0]:
                x = x * 2
        return x


def test_a_planned_scan_gives_the_loops_result_and_stand_ins_in_between(device):
    reference, model = converted(Loop(), device)
    x = torch.randn(2, HIDDEN, device=device)
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 1 and not one_by_one
    close(output, reference(x), TRAINING)
    # The layers before the last gave stand-ins (placeholders), which the forward did not use.
    assert [is_placeholder(each) for each in model.seen] == [True, True, False]
    # A later call of the same kind runs by the same plan.
    output, loops, one_by_one = forward_with_warnings(model, x + 1)
    assert loops == 1 and not one_by_one
    close(output, reference(x + 1), TRAINING)


def test_per_layer_arguments_are_chosen_inside_the_scan(device):
    reference, model = converted(Loop(), device)
    scale, shifts = torch.randn(HIDDEN, device=device), torch.randn(2, HIDDEN, device=device)
    for which in (reference, model):
        which.arguments = [dict(scale=scale, shift=shifts[index % 2]) for index in range(3)]
    x = torch.randn(2, HIDDEN, device=device)
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 1 and not one_by_one
    close(output, reference(x), TRAINING)


def test_a_call_out_of_order_raises(device):
    _, model = converted(Loop(), device)
    x = torch.randn(2, HIDDEN, device=device)
    forward_with_warnings(model, x)  # planned: layers 0, 1, 2, as one scan
    model.order[1:] = [2, 1]  # no plain setting: the same kind of call
    with pytest.raises(RuntimeError, match=r"layer 2 is called out of order: layers 0-2 run as "
                                           r"one scan, and the calls so far were of layers 0-0"):
        model(x)
    # The forward's end was seen all the same: the next call runs by its plan.
    model.order[1:] = [1, 2]
    assert forward_with_warnings(model, x)[1:] == (1, [])


def test_another_hidden_state_than_the_layer_before_returned_raises(device):
    _, model = converted(Loop(), device)
    x = torch.randn(2, HIDDEN, device=device)
    forward_with_warnings(model, x)
    model.doubles[0] = True
    with pytest.raises(RuntimeError, match=r"layer 1 got another hidden state than layer 0 "
                                           r"returned: layers 0-2 run as one scan"):
        model(x)


def test_another_shared_argument_or_another_form_raises(device):
    _, model = converted(Loop(), device)
    scale, shift = torch.randn(HIDDEN, device=device), torch.randn(HIDDEN, device=device)
    model.arguments = [dict(scale=scale, shift=shift) for _ in range(3)]
    x = torch.randn(2, HIDDEN, device=device)
    forward_with_warnings(model, x)  # planned with the same scale and shift for every layer
    model.arguments[2] = dict(scale=scale, shift=shift.clone())
    with pytest.raises(ValueError, match=r"layer 2 is called with another argument \(leaf 2 of "
                                         r"its arguments\) than layer 0, which the loop gave the "
                                         r"same one when this kind of call was planned"):
        model(x)
    model.arguments[2] = dict(scale=scale)
    with pytest.raises(ValueError, match=r"layer 2 is called with arguments of another form "
                                         r"than layer 0: layers 0-2 run as one scan"):
        model(x)


class Indexed(Block):
    """Reads its own index, which differs between layers: no trace stands for all."""

    def forward(self, x, **unused):
        return super().forward(x) * self.layer_idx


def test_a_scan_that_cannot_run_runs_the_layers_one_by_one_with_a_warning(device):
    model = Loop()
    model.blocks = nn.ModuleList(Indexed() for _ in range(3))
    for index, block in enumerate(model.blocks):
        block.layer_idx = index + 1
    reference, model = converted(model, device)
    x = torch.randn(2, HIDDEN, device=device)
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 0 and len(one_by_one) == 1
    assert one_by_one[0].startswith("The 3 layers ran one by one") and "layer_idx" in one_by_one[0]
    close(output, reference(x), TRAINING)
    assert not any(is_placeholder(each) for each in model.seen)
