"""Layers that differ only in Python numbers of their arithmetic (a per-layer
scale, as DiffLlama's `lambda_init`) run as one scan that takes those numbers
per layer (layer_stack.lifted_numbers): trained, with the for loop's losses,
gradients and weights; numbers equal in every layer stay constants of the
trace; a number used where a tensor cannot go (a norm's eps, a Python `if`)
still keeps the layers apart, one by one, naming the setting; a step that
computes with other numbers than its trace for the plan runs one by one."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
import torch_xla
from torch import nn

from layer_calls import HIDDEN, Loop, converted, forward_with_warnings, planned
from per_layer import per_layer_grads, per_layer_parameters
from test_hf import make_diffllama
from test_hf_layer_kinds import assert_same_step, training_step_of_both
from tolerances import TRAINING, close, close_by_name
from torch_xla_ext.hf import stack_layers

LAYERS = 3


class Scaled(nn.Module):
    """A linear layer mixed with its input by a per-layer scale (as
    DiffLlama's `lambda_init`: `0.8 - 0.6 * exp(-0.3 * index)`), its numbers
    the operands of the tensors' arithmetic, plus an `eps` equal in every layer."""

    def __init__(self, index: int):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.scale = 0.8 - 0.6 * math.exp(-0.3 * index)
        self.eps = 1e-3

    def forward(self, x):
        mixed = (1 - self.scale) * self.linear(x).tanh() + x / (1 + self.scale)
        return mixed * self.scale + self.eps


class Normed(nn.Module):
    """The scale as above, and a per-layer eps passed to a norm, which takes
    it as a number of its own, not as an operand of arithmetic."""

    def __init__(self, index: int):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.scale = 0.5 + 0.1 * index
        self.eps = 10.0 ** -(index + 3)

    def forward(self, x):
        return F.layer_norm(self.linear(x) * self.scale, (HIDDEN,), eps=self.eps)


def looped(kind):
    """LAYERS layers of `kind`, built with their index, in a loop."""
    torch.manual_seed(0)
    return Loop(nn.ModuleList(kind(index) for index in range(LAYERS)))


def test_layers_differing_in_numbers_of_their_arithmetic_train_as_one_scan(device):
    reference, model = converted(looped(Scaled), device)
    x = torch.randn(2, HIDDEN, device=device)
    (run,) = planned(model, x)[0].runs
    assert run.how == "scan"
    scales = tuple(layer.scale for layer in reference.blocks)
    assert run.numbers is not None and scales in run.numbers.values
    optimizers = [torch.optim.SGD(which.parameters(), lr=0.1) for which in (reference, model)]
    for step in range(2):
        losses, grads = [], []
        for which, optimizer in zip((reference, model), optimizers):
            optimizer.zero_grad()
            output, loops, one_by_one = forward_with_warnings(which, x + step)
            loss = output.square().mean()
            loss.backward()
            grads.append(per_layer_grads(which))
            optimizer.step()
            torch_xla.sync()
            losses.append(loss)
        assert loops == 1 and not one_by_one  # the converted model's call: one scan
        close(losses[1], losses[0], TRAINING)
        close_by_name(grads[1], grads[0], TRAINING)
    weights, reference_weights = ({name: weight.data for name, weight in
                                   per_layer_parameters(which).items()}
                                  for which in (model, reference))
    close_by_name(weights, reference_weights, TRAINING)


def test_numbers_equal_in_every_layer_stay_constants_of_the_trace(device):
    _, model = converted(looped(Scaled), device)
    x = torch.randn(2, HIDDEN, device=device)
    plan, record = planned(model, x)
    (run,) = plan.runs
    numbers = record.calls["blocks"][0].numbers
    # Each layer computes with 1 - scale, 1 + scale, scale and eps: only the
    # three numbers made of the scale differ, and only they are lifted.
    assert [number.value for number in numbers] == [
        1 - model.blocks[0].scale, 1 + model.blocks[0].scale, model.blocks[0].scale, 1e-3]
    assert run.numbers.ordinals == (0, 1, 2)
    # The scan takes the lifted numbers as [layers] inputs of the graph, no more.
    output, loops, _ = forward_with_warnings(model, x)
    inputs = torch_xla._XLAC._get_xla_tensors_hlo([output]).splitlines()[0]
    assert loops == 1 and inputs.count(f"f32[{LAYERS}]{{0}}") == 3


def test_a_number_a_norm_takes_keeps_the_layers_apart_naming_the_setting(device):
    reference, model = converted(looped(Normed), device)
    x = torch.randn(2, HIDDEN, device=device)
    plan, record = planned(model, x)
    # The scale of the arithmetic differs, and would be lifted...
    assert [call.numbers[0].value for call in record.calls["blocks"]] == [
        layer.scale for layer in reference.blocks]
    # ...but the norm's eps is a constant of its own, so the layers still compute differently.
    (run,) = plan.runs
    assert run.how == "one by one" and run.numbers is None
    assert "the settings that differ between layers 0-2: eps, scale" in run.reason
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 0 and len(one_by_one) == 1 and "eps, scale" in one_by_one[0]
    close(output, reference(x), TRAINING)


class Branching(Normed):
    """The scale read by a Python `if`, which no tensor can stand for."""

    def forward(self, x):
        x = self.linear(x) * self.scale
        return x.tanh() if self.scale > 0.55 else x


def test_a_number_a_branch_reads_keeps_the_layers_apart(device):
    reference, model = converted(looped(Branching), device)
    x = torch.randn(2, HIDDEN, device=device)
    plan, record = planned(model, x)
    assert len({call.numbers for call in record.calls["blocks"]}) == LAYERS
    assert all(run.numbers is None and run.how != "scan" for run in plan.runs)
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 0 and one_by_one and "scale" in one_by_one[0]
    close(output, reference(x), TRAINING)


class OnXla(Normed):
    """Computes with one more number on an XLA device than elsewhere (where
    its program was traced, on fakes on the CPU), before its scale."""

    def forward(self, x):
        x = self.linear(x)
        if x.device.type == "xla":
            x = x * 2.0
        return x * self.scale


def test_a_step_computing_with_other_numbers_than_its_trace_runs_one_by_one(device):
    # The lifted ordinal would name the 2.0 in the scan's step: the step sees
    # that its numbers are not those of its trace for the plan, and the
    # layers run as the loop does.
    reference, model = converted(looped(OnXla), device)
    x = torch.randn(2, HIDDEN, device=device)
    (run,) = planned(model, x)[0].runs
    assert run.how == "scan" and run.numbers.ordinals == (0,)
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 0 and len(one_by_one) == 1
    assert "computed with number 0 of its arithmetic (2.0 with a torch.float32 tensor) " \
           "otherwise than when its program was traced for the plan (0.5 with a " \
           "torch.float32 tensor)" in one_by_one[0]
    close(output, reference(x), TRAINING)


def test_diffllamas_layers_train_as_one_scan(device):
    # Its attention's lambda_init = 0.8 - 0.6 * exp(-0.3 * layer_idx) differs
    # between the layers, in arithmetic only.
    reference = make_diffllama(LAYERS, attn_implementation="eager")
    model = stack_layers(copy.deepcopy(reference))
    step = training_step_of_both(reference, model, device)
    assert step["one_by_one"] == []
    assert step["while_loops"] == 2  # the forward's scan and the backward's
    assert_same_step(step)
