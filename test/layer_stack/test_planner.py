"""What an owner's forward does with its stacked layers, found by a dry run
(layer_stack.dry_run), and the plan of its calls made from it
(layer_stack.planner), on small owners: a plain loop is one scan, work or
a value read between layers runs them one by one naming the line, layers of
two structures are two runs, and per-layer outputs the forward keeps are
the scan's."""
import pytest
import torch
from torch import nn

from layer_calls import HIDDEN, Block, Loop, planned
from torch_xla_ext.layer_stack import StackedList
from torch_xla_ext.layer_stack.planner import Leaf
from torch_xla_ext.layer_stack.dry_run import Source


class Wide(Block):
    """Another structure: a second linear layer."""

    def __init__(self):
        super().__init__()
        self.other = nn.Linear(HIDDEN, HIDDEN)


class Owner(Loop):
    def __init__(self, *kinds):
        torch.manual_seed(0)
        super().__init__(StackedList([kind() for kind in kinds or (Block, Block, Block)]))


def test_a_plain_loop_is_one_scan(device):
    plan, record = planned(Owner().to(device), torch.randn(2, HIDDEN, device=device))
    assert record.failure is None and record.read is None
    assert [call.index for call in record.calls["blocks"]] == [0, 1, 2]
    (run,) = plan.runs
    assert plan.reason is None and (run.start, run.stop, run.how) == (0, 3, "scan")
    assert run.period == 1 and run.trigger == 0 and run.leaves == ((Leaf("carried"),),)
    assert run.kept == ((),)  # the forward uses the last hidden state only


class SharedAndChosen(Owner):
    def forward(self, x):
        for index, block in enumerate(self.blocks):
            x = block(x, self.scale, self.shifts[index])
        return x


def test_arguments_are_shared_or_chosen_per_layer_and_the_scan_waits_for_the_last(device):
    owner = SharedAndChosen().to(device)
    owner.scale = torch.randn(HIDDEN, device=device)
    owner.shifts = [torch.randn(HIDDEN, device=device) for _ in range(2)]
    owner.shifts.append(owner.shifts[0])  # layer 2 gets layer 0's
    plan, _ = planned(owner, torch.randn(2, HIDDEN, device=device))
    (run,) = plan.runs
    assert run.how == "scan" and run.leaves == (
        (Leaf("carried"), Leaf("shared"), Leaf("chosen", (0, 1, 0))),)
    assert run.trigger == 1  # the call by which each variant has been given


class WorksBetween(Owner):
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            x = x * 2
        return x


def test_work_between_layers_runs_them_one_by_one_naming_the_line(device):
    plan, _ = planned(WorksBetween().to(device), torch.randn(2, HIDDEN, device=device))
    (run,) = plan.runs
    assert (run.start, run.stop, run.how) == (0, 3, "one by one")
    assert "the forward works on what layer 0 returned before layer 1 gets it" in run.reason
    assert "test_planner.py:" in run.reason and "`x = x * 2`" in run.reason


class ReadsBetween(Owner):
    """Skips the layers whose flag is off, as LayerDrop does with a random draw."""

    def forward(self, x):
        for keep, block in zip(torch.tensor(self.keep), self.blocks):
            if keep:
                x = block(x)
        return x


@pytest.mark.parametrize("keep", [[True, True, True], [False, True, True]],
                         ids=["all-called", "layer-0-skipped"])
def test_a_value_read_between_layers_runs_the_call_one_by_one_naming_the_line(device, keep):
    owner = ReadsBetween().to(device)
    owner.keep = keep
    rng = torch.get_rng_state()
    plan, record = planned(owner, torch.randn(2, HIDDEN, device=device))
    assert [call.index for call in record.calls["blocks"]] == [
        index for index, kept in enumerate(keep) if kept]
    assert plan.runs == () and plan.reason.startswith(
        "the forward reads a tensor's value while it loops over the layers")
    assert "test_planner.py:" in plan.reason and "`if keep:`" in plan.reason
    assert torch.equal(torch.get_rng_state(), rng)  # the real call draws what it would have


def test_layers_of_two_structures_are_two_runs(device):
    owner = Owner(Block, Block, Wide, Wide).to(device)
    assert len(owner.blocks.plan) == 2
    plan, _ = planned(owner, torch.randn(2, HIDDEN, device=device))
    assert [(run.start, run.stop, run.segment, run.how) for run in plan.runs] == [
        (0, 2, 0, "scan"), (2, 4, 1, "scan")]


class KeepsOutputs(Owner):
    def forward(self, x):
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        return torch.stack(outputs)


def test_per_layer_outputs_the_forward_keeps_are_planned_from_the_scan(device):
    plan, record = planned(KeepsOutputs().to(device), torch.randn(2, HIDDEN, device=device))
    (run,) = plan.runs
    assert run.how == "scan" and run.kept == ((0,),)
    assert "`return torch.stack(outputs)`" in next(iter(record.used.values()))


def test_per_layer_outputs_of_a_scan_over_groups_are_planned_one_by_one_saying_why(device):
    # A scan over groups hands back each group's last hidden state only: the
    # plan says so, before anything is traced.
    owner = KeepsOutputs(Block, Wide, Block, Wide).to(device)
    assert owner.blocks.plan[0].period == 2
    plan, _ = planned(owner, torch.randn(2, HIDDEN, device=device))
    (run,) = plan.runs
    assert run.how == "one by one" and run.reason == (
        "the forward keeps each layer's output, and the scan over groups of layers stacks the "
        "groups' last hidden states only")


class Aux(Block):
    def forward(self, x, scale):
        return self.linear(self.norm(x)), scale, 3, self.norm(x)


class HandsOn(Owner):
    def forward(self, x):
        for block in self.blocks:
            x, _, _, _ = block(x, self.scale)
        return x


def test_the_dry_run_records_where_each_output_comes_from(device):
    owner = HandsOn(Aux, Aux).to(device)
    owner.scale = torch.ones(1, device=device)
    plan, record = planned(owner, torch.randn(2, HIDDEN, device=device))
    first, second = record.calls["blocks"]
    assert first.sources == (Source("computed", ((2, HIDDEN), torch.float32)),
                             Source("argument", 1), Source("constant", 3),
                             Source("computed", ((2, HIDDEN), torch.float32)))
    # The layer's output is a stand-in the next layer gets; its argument is itself.
    assert second.leaves[0] is first.outputs[0] and first.outputs[1] is owner.scale
    assert plan.runs[0].how == "scan"


class UsesAValue(Owner):
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            if x.sum() > 0:  # a computed value: the dry run's stand-in has none
                x = -x
        return x


def test_a_dry_run_that_stops_runs_the_call_one_by_one_saying_where(device):
    plan, record = planned(UsesAValue().to(device), torch.randn(2, HIDDEN, device=device))
    assert plan.runs == () and plan.reason == record.failure
    assert plan.reason.startswith("UsesAValue.forward, run once with its layers recorded on "
                                  "stand-ins, raised PlaceholderError at ")
    assert "test_planner.py:" in plan.reason
