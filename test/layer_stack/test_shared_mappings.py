"""A mapping that the forward passes to every layer, whose entries some
layers write and later layers read (layer_stack.shared_mappings): the
layers around the writer still scan, each given the entries there at its
call, and the results are the loop's."""
import collections
import copy
import warnings

import pytest
import torch
import torch_xla
from torch import nn

from layer_calls import HIDDEN, converted, forward_with_warnings
from per_layer import per_layer_grads
from tolerances import TRAINING, close, close_by_name
from torch_xla_ext.layer_stack import LayerByLayerWarning, LayerStack


class Shared(collections.UserDict):
    """A mapping that pytree keeps as one leaf, as transformers' KVSharingDict."""


class SharingBlock(nn.Module):
    """A norm and a linear layer; puts twice its output in `shared[stores]`,
    and adds `shared[reads]` to it, where set."""

    def __init__(self, stores=None, reads=None):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.stores, self.reads = stores, reads

    def forward(self, x, shared):
        x = self.linear(self.norm(x))
        if self.reads is not None:
            x = x + shared[self.reads]
        if self.stores is not None:
            shared[self.stores] = x * 2
        return x


class SharingLoop(nn.Module):
    """Calls its blocks in order, each given `shared` (a new Shared unless
    passed); keeps the mapping it gave them in `given`."""

    def __init__(self, settings):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(SharingBlock(**each) for each in settings)
        self.given = None

    def forward(self, x, shared=None):
        self.given = Shared() if shared is None else shared
        for block in self.blocks:
            x = block(x, self.given)
        return x


def test_layers_around_the_one_that_writes_an_entry_scan_and_train_as_the_loop(device):
    # Layers 0-1 alike, layer 2 writes "kv", layers 3-4 read it.
    settings = [{}, {}, dict(stores="kv"), dict(reads="kv"), dict(reads="kv")]
    reference, model = converted(SharingLoop(settings), device)
    x = torch.randn(2, HIDDEN, device=device)
    for _ in range(2):  # the first call plans, the second runs by the same plan
        output, loops, one_by_one = forward_with_warnings(model, x)
        assert loops == 2 and not one_by_one
        expected = reference(x)
        close(output, expected, TRAINING)
        assert list(model.given) == ["kv"]
        close(model.given["kv"], reference.given["kv"], TRAINING)
    output.sum().backward()
    expected.sum().backward()
    torch_xla.sync()  # one graph for every gradient, not one per comparison
    close_by_name(per_layer_grads(model),
                  {name: param.grad for name, param in reference.named_parameters()}, TRAINING)


def test_layers_that_read_entries_chosen_by_a_setting_scan_as_a_pattern_of_their_kinds(device):
    # Layers 2-5 read "a", "b", "a", "b" (their `reads` setting): one
    # template's trace, reading one entry, would stand for them all wrongly.
    settings = [dict(stores="a"), dict(stores="b")] + [dict(reads="a"), dict(reads="b")] * 2
    reference, model = converted(SharingLoop(settings), device)
    x = torch.randn(2, HIDDEN, device=device)
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 1 and not one_by_one
    close(output, reference(x), TRAINING)


def test_a_mapping_the_caller_passes_is_left_as_the_layers_leave_it(device):
    settings = [dict(reads="given"), dict(reads="given"), dict(stores="kv")]
    reference, model = converted(SharingLoop(settings), device)
    x, given = torch.randn(2, HIDDEN, device=device), torch.randn(2, HIDDEN, device=device)
    ours, theirs = Shared(given=given), Shared(given=given)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = model(x, ours)
    assert not [each for each in caught if each.category is LayerByLayerWarning]
    close(output, reference(x, theirs), TRAINING)
    assert ours.keys() == theirs.keys() and ours["given"] is given
    close(ours["kv"], theirs["kv"], TRAINING)


def test_an_empty_mapping_that_no_layer_touches_passes_through_one_scan(device):
    reference, model = converted(SharingLoop([{}] * 3), device)
    x = torch.randn(2, HIDDEN, device=device)
    output, loops, one_by_one = forward_with_warnings(model, x)
    assert loops == 1 and not one_by_one
    close(output, reference(x), TRAINING)
    assert not model.given


def test_a_layer_stack_whose_layers_write_the_mapping_runs_them_one_by_one_saying_why(device):
    torch.manual_seed(0)
    layers = [SharingBlock(stores="kv") for _ in range(3)]
    reference = copy.deepcopy(layers)
    stack = LayerStack(layers).to(device)
    x = torch.randn(2, HIDDEN, device=device)
    ours, theirs = Shared(), Shared()
    with pytest.warns(LayerByLayerWarning, match=r"writes entries \['kv'\] of argument args\[0\]"):
        output = stack(x, ours)
    expected = x
    for layer in reference:
        expected = layer.to(device)(expected, theirs)
    close(output, expected, TRAINING)
    close(ours["kv"], theirs["kv"], TRAINING)
