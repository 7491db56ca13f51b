"""An optimizer made before stack_layers holds the layers' own parameters,
which the stacks replaced: its step raises a ValueError naming them, before
anything changes, where it used to leave the layers untrained without a word.
Optimizers made afterwards, and parameters the model keeps, step as before."""
import warnings

import pytest
import torch
import torch_xla
from torch import nn

import torch_xla_ext as tx
from layer_calls import HIDDEN, Block
from test_hf import VOCAB, make_model


def step(model, optimizer):
    device = torch_xla.device()
    ids = torch.randint(0, VOCAB, (2, 8), device=device)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    torch_xla.sync()


def test_an_optimizer_made_before_converting_refuses_to_step_naming_the_parameters():
    device = torch_xla.device()
    model = make_model(layers=3).to(device)
    made_before = torch.optim.SGD(model.parameters(), lr=0.1)
    tx.stack_layers(model)
    before = {name: tensor.cpu().clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^SGD.step\(\): 27 of its parameters are the "
                                         r"unconverted layers' own \('model.layers.0.self_attn"
                                         r".q_proj.weight', .* and 24 more\), which stack_layers "
                                         r"replaced.*made before converting"):
        step(model, made_before)
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name].cpu()) for name in before)
    step(model, torch.optim.SGD(model.parameters(), lr=0.1))  # made after: steps


def test_an_optimizer_of_the_parameters_the_model_keeps_steps_as_before():
    device = torch_xla.device()
    model = make_model(layers=3).to(device)
    head = torch.optim.SGD(model.lm_head.parameters(), lr=0.1)  # made before, not the layers'
    tx.stack_layers(model)
    weight = model.lm_head.weight.cpu().clone()
    step(model, head)
    assert not torch.equal(model.lm_head.weight.cpu(), weight)


class Wide(Block):
    def __init__(self):
        super().__init__()
        self.other = nn.Linear(HIDDEN, HIDDEN)


class Owner(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Wide(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_layers_held_as_themselves_keep_their_parameters_and_their_optimizer():
    torch.manual_seed(0)
    model = Owner().to(torch_xla.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each built otherwise than its neighbours
        tx.stack_layers(model)
    weight = model.layers[1].linear.weight.cpu().clone()
    model(torch.randn(2, HIDDEN, device=torch_xla.device())).sum().backward()
    optimizer.step()
    assert not torch.equal(model.layers[1].linear.weight.cpu(), weight)
