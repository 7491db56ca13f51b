"""A forward that passes each layer its own index as an argument
(`for i, layer in enumerate(layers): layer(h, i)`, as Zamba2's does) runs
its alike layers as one scan, the index opaque inside the step
(layer_stack.call_leaves); a layer that uses that index runs one by one,
saying so; and alike layers that a forward calls with other differing
values run one by one with a warning naming the argument, not silently each
as itself."""
import pytest
import torch
from torch import nn

from layer_calls import HIDDEN, Block, converted, forward_with_warnings, planned
from per_layer import per_layer_grads
from tolerances import TRAINING, close
from torch_xla_ext.layer_stack.planner import Leaf

LAYERS = 3


class Indexed(nn.Module):
    """Blocks, each called with `index_of(i)` after the hidden state."""

    def __init__(self, block, index_of=lambda index: index):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(block() for _ in range(LAYERS))
        self.index_of = index_of

    def forward(self, x):
        for index, block in enumerate(self.blocks):
            x = block(x, self.index_of(index))
        return x


class Handing(nn.Module):
    """A block that takes its index and hands it on to nothing it computes with."""

    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x, index):
        return self.block(x)


class Using(Handing):
    """A block that scales its output by its index: its arithmetic uses it."""

    def forward(self, x, index):
        return self.block(x) * (index + 1)


def test_layers_given_their_own_index_train_as_one_scan(device):
    reference, model = converted(Indexed(Handing), device)
    x = torch.randn(2, HIDDEN, device=device, requires_grad=True)
    (run,) = planned(model, x)[0].runs
    assert run.how == "scan" and run.leaves == ((Leaf("carried"), Leaf("index")),)
    grads = []
    for which in (reference, model):
        output, loops, one_by_one = forward_with_warnings(which, x)
        output.square().mean().backward()
        grads.append(per_layer_grads(which))
    assert loops == 1 and one_by_one == []  # the converted call: one scan, no warning
    close(output, reference(x), TRAINING)
    for name, grad in grads[0].items():
        close(grads[1][name], grad, TRAINING, name)


def test_a_layer_using_its_index_runs_one_by_one_saying_so(device):
    reference, model = converted(Indexed(Using), device)
    x = torch.randn(2, HIDDEN, device=device)
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 0 and len(one_by_one) == 1
    assert "the index argument the forward passes each layer" in one_by_one[0]
    close(output, reference(x), TRAINING)


def test_alike_layers_given_other_differing_values_run_one_by_one_with_a_warning(device):
    # Twice the index is not each layer's own: the layers are not called
    # alike, and the warning names the argument (they used to run each as
    # itself without a word).
    reference, model = converted(Indexed(Handing, lambda index: 2 * index), device)
    x = torch.randn(2, HIDDEN, device=device)
    (run,) = planned(model, x)[0].runs
    assert (run.start, run.stop, run.how) == (0, LAYERS, "one by one")
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 0 and len(one_by_one) == 1
    assert "layer 1 is given args[1] = 2, and layer 0 0" in one_by_one[0]
    close(output, reference(x), TRAINING)
