"""A forward that indexes its layer list (`self.blocks[i](x)`, as XLM's
does) is driven as one that iterates it: its calls are planned, alike
layers called on each other's outputs run as one scan, and work between
the calls makes them run one by one with a warning naming the line, not
each as itself without a word. Outside the forward, `blocks[i]` is layer
i as a module."""
import pytest
import torch
from torch import nn

from layer_calls import HIDDEN, Block, converted, forward_with_warnings
from per_layer import per_layer_grads
from tolerances import TRAINING, close

LAYERS = 3


class IndexedLoop(nn.Module):
    """Calls `blocks[i]` for i in order; with `norms`, a norm of another
    list after each block, as XLM's forward does."""

    def __init__(self, with_norms: bool):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(LAYERS if with_norms else 0))

    def forward(self, x):
        for index in range(len(self.blocks)):
            x = self.blocks[index](x)
            if self.norms:
                x = self.norms[index](x)
        return x


def test_an_indexed_loop_trains_as_one_scan(device):
    reference, model = converted(IndexedLoop(with_norms=False), device)
    x = torch.randn(2, HIDDEN, device=device)
    grads = []
    for which in (reference, model):
        output, loops, one_by_one = forward_with_warnings(which, x)
        output.square().mean().backward()
        grads.append(per_layer_grads(which))
    assert loops == 1 and one_by_one == []
    close(output, reference(x), TRAINING)
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        close(grads[1][name], grad, TRAINING, name)


def test_work_between_indexed_calls_runs_them_one_by_one_naming_the_line(device):
    reference, model = converted(IndexedLoop(with_norms=True), device)
    x = torch.randn(2, HIDDEN, device=device)
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 0 and len(one_by_one) == 1
    assert "the forward works on what layer 0 returned" in one_by_one[0]
    assert "x = self.norms[index](x)" in one_by_one[0]
    close(output, reference(x), TRAINING)


def test_outside_the_forward_an_index_gives_the_layer_as_a_module(device):
    _, model = converted(IndexedLoop(with_norms=False), device)
    assert isinstance(model.blocks[-1], Block)
    assert torch.equal(model.blocks[-1].linear.weight, model.blocks[LAYERS - 1].linear.weight)
    with pytest.raises(IndexError, match=f"Layer index {LAYERS} is out of range for {LAYERS}"):
        model.blocks[LAYERS]
