"""Layers that keep state on their own modules (layer_stack.layer_state): a
layer that sets an attribute on itself while it runs, read by its next call
or from outside the forward, runs one by one on a module that keeps it, as
the unconverted layer does; the warning names the attribute; layers that
set none still scan."""
import copy
import pickle

import pytest
import torch
import torch_xla
from torch import nn

from layer_calls import HIDDEN, Block, Loop, converted, forward_with_warnings, planned
from torch_xla_ext.layer_stack import StackedList


class Remembering(Block):
    """Adds what it returned in its previous call (kept on a submodule) to its output."""

    def __init__(self):
        super().__init__()
        self.linear.previous = None

    def forward(self, x):
        output = super().forward(x)
        if self.linear.previous is not None:
            output = output + self.linear.previous
        self.linear.previous = output.detach()
        return output


def loop_of(*kinds):
    """The blocks of `kinds` in a loop (a ModuleList, as unconverted)."""
    torch.manual_seed(0)
    return Loop(nn.ModuleList([kind() for kind in kinds]))


def test_layers_that_set_attributes_run_one_by_one_and_keep_them_between_calls(device):
    reference, model = converted(loop_of(Block, Block, Remembering, Remembering, Block, Block),
                                 device)
    for call in range(2):  # the second call reads what the first one kept
        x = torch.randn(2, HIDDEN, device=device)
        output, loops, warned = forward_with_warnings(model, x)
        torch.testing.assert_close(output.cpu(), reference(x).cpu())
        assert loops == 2  # layers 0-1 and 4-5 still scan
        assert warned == ["The 2 layers ran one by one, as the for loop does, instead of as one "
                          "scan: layer 2 sets its attributes ['linear.previous'] while it runs, "
                          "which a scan's steps cannot keep per layer: such layers run one by "
                          "one, each keeping its own, as unconverted."]
        torch_xla.sync()  # the kept outputs are data, not graphs of this call
    for index in (2, 3):  # the layers as modules, outside the forward, hold it too
        torch.testing.assert_close(model.blocks[index].linear.previous.cpu(),
                                   reference.blocks[index].linear.previous.cpu())
    assert model.blocks[0] is model.blocks[0]  # every layer is itself


def test_a_kept_layer_s_tensors_are_the_stack_s_and_its_state_survives_copies(device):
    _, model = converted(loop_of(Remembering, Remembering), device)
    x = torch.randn(2, HIDDEN, device=device)
    model(x)
    kept = model.blocks[1]
    assert kept is model.blocks[1]
    with torch.no_grad():
        model.blocks.segments[0].storage.stacked["linear.weight"].mul_(2)
    torch.testing.assert_close(model.blocks[1].linear.weight.cpu(),
                               model.blocks.segments[0].storage.stacked["linear.weight"][1].cpu())
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model.cpu()))):
        torch.testing.assert_close(other.blocks[1].linear.previous.cpu(),
                                   kept.linear.previous.cpu())
    (unstacked_previous, kept_previous) = (model.blocks.unstacked()[1].linear.previous,
                                           model.blocks[1].linear.previous)
    assert unstacked_previous is kept_previous


def test_the_dry_run_names_the_attributes_and_leaves_none_on_the_layers(device):
    owner = loop_of(Remembering, Remembering, Block).to(device)
    owner.blocks = StackedList(owner.blocks)
    plan, record = planned(owner, torch.randn(2, HIDDEN, device=device))
    assert [call.attributes for call in record.calls["blocks"]] == [
        ("linear.previous",), ("linear.previous",), ()]
    assert [(run.start, run.stop, run.how) for run in plan.runs] == [
        (0, 2, "one by one"), (2, 3, "itself")]
    assert all(owner.blocks[index].linear.previous is None for index in range(2))
