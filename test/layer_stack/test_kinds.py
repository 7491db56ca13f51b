"""Layers of several kinds (layer_stack.kinds): per-layer arguments
(`PerLayerChoice`) in one scan against the for loop, and what a layer
computes (`program_of`), which tells a setting only handed on from one that
changes the computation."""
import re
import warnings

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
from torch import nn
from torch.utils._pytree import tree_flatten

from torch_xla_ext.layer_stack import LayerByLayerWarning, LayerStack
from torch_xla_ext.layer_stack.kinds import (
    PerLayerChoice, call_for_layer, program_of, same_leaf)
from tolerances import DTYPE_DEFAULT, THROUGH_LAYERS, close

HIDDEN = 8


class Scaled(nn.Module):
    """A linear layer whose output is scaled by an argument; `window` is a
    setting its forward reads only to hand on (or, with `uses_window`, to
    scale by, through a tensor it makes)."""

    def __init__(self, window=None, uses_window=False):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.window, self.uses_window = window, uses_window

    def forward(self, hidden, scale, **ignored):
        output = torch.tanh(self.linear(hidden)) * scale
        if self.uses_window and self.window is not None:
            output = output * torch.tensor([[float(self.window)] * HIDDEN])
        return _hand_on(output, window=self.window)


def _hand_on(output, **ignored):
    return output


def test_a_per_layer_choice_gives_each_layer_its_variant_inside_one_scan(device):
    torch.manual_seed(0)
    layers = [Scaled() for _ in range(3)]
    stack = LayerStack(layers).to(device)
    hidden = torch.randn(2, HIDDEN, device=device)
    variants = [torch.randn(HIDDEN, device=device, requires_grad=True) for _ in range(2)]
    choice = PerLayerChoice(tuple(variants), (0, 1, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayerByLayerWarning)
        output = stack(hidden, choice)
    output.sum().backward()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([output])
    assert len(re.findall(r"\bwhile\(", hlo)) == 1
    scanned = (output, *(variant.grad for variant in variants))
    for variant in variants:
        variant.grad = None
    expected = hidden
    for index, layer in enumerate(layers):
        expected = layer.to(device)(expected, variants[(0, 1, 0)[index]])
    expected.sum().backward()
    for actual, wanted in zip(scanned, (expected, *(variant.grad for variant in variants))):
        close(actual, wanted, THROUGH_LAYERS)
    # The layers' choices go to the device once: a later call uploads nothing.
    uploads = []
    for _ in range(2):
        transfers = met.metric_data("TransferToDeviceTime")[0]
        stack(hidden, PerLayerChoice(tuple(variants), (0, 1, 0))).sum().backward()
        torch_xla.sync()
        uploads.append(met.metric_data("TransferToDeviceTime")[0] - transfers)
    assert uploads[1] == 0, uploads


def test_variants_a_scan_cannot_pick_among_run_layer_by_layer(device):
    torch.manual_seed(0)
    layers = [Scaled() for _ in range(2)]
    stack = LayerStack(layers).to(device)
    hidden = torch.randn(2, HIDDEN, device=device)
    scales = (torch.randn(HIDDEN, device=device), torch.randn(1, device=device))
    with pytest.warns(LayerByLayerWarning, match=r"argument args\[0\] differs between the "
                                                 r"layers' kinds \(\(8,\) torch.float32, \(1,\) "
                                                 r"torch.float32\)"):
        output = stack(hidden, PerLayerChoice(scales, (0, 1)))
    expected = layers[1].to(device)(layers[0].to(device)(hidden, scales[0]), scales[1])
    close(output, expected, DTYPE_DEFAULT)


def test_a_layers_call_takes_its_variant_of_each_choice():
    first, second = torch.ones(1), torch.zeros(1)
    choice = PerLayerChoice((first, second), (0, 1, 1, 0))
    assert [choice.for_layer(index) is (first, second)[which]
            for index, which in enumerate((0, 1, 1, 0))] == [True] * 4
    # Anywhere in the call's arguments, nested or not; the rest as it is.
    args, kwargs = call_for_layer((choice, 3), {"masks": [choice, None], "flag": True}, 2)
    assert args[0] is second and args[1] == 3
    assert kwargs["masks"][0] is second and kwargs["masks"][1] is None and kwargs["flag"] is True


def test_a_leaf_is_the_same_as_the_very_object_or_an_equal_plain_constant():
    tensor = torch.ones(1)
    assert same_leaf(tensor, tensor) and not same_leaf(torch.ones(1), tensor)
    assert same_leaf(4, 4) and same_leaf("sliding", "sliding") and same_leaf(None, None)
    # Equal values of other types would trace differently (True == 1 == 1.0).
    assert not same_leaf(True, 1) and not same_leaf(1.0, 1)
    assert not same_leaf([1], [1])  # not a plain constant: only the very object


def call_leaves(*args, **kwargs) -> tuple[list, object]:
    return tree_flatten((args, kwargs))


def program(layer, leaves, spec) -> tuple:
    """What `layer` computes (`program_of`'s program, without its numbers)."""
    return program_of(layer, leaves, spec)[0]


def test_a_program_tells_a_setting_handed_on_from_one_that_computes():
    leaves, spec = call_leaves(torch.randn(2, HIDDEN), torch.randn(HIDDEN))
    # Only handed on: the same program for both settings.
    assert program(Scaled(window=4), leaves, spec) == program(Scaled(), leaves, spec)
    # Read into a constant the layer makes (of two dimensions): the constants differ.
    four, two = (program(Scaled(window=window, uses_window=True), leaves, spec)
                 for window in (4, 2))
    assert four[0] == two[0] and four[1] != two[1]
    assert len({four, two}) == 2  # programs are hashable: runs are split by them
    # Read to branch: the graphs differ.
    assert program(Scaled(uses_window=True), leaves, spec)[0] != four[0]
    # Other weights, the same program: it is the code and constants, not the values.
    assert program(Scaled(), leaves, spec) == program(Scaled(), leaves, spec)


def test_a_program_holds_the_backward_to_what_requires_grad():
    leaves, spec = call_leaves(torch.randn(2, HIDDEN), torch.randn(HIDDEN))
    frozen = Scaled().requires_grad_(False)
    forward_only = program(frozen, leaves, spec)
    trained = program(Scaled(), leaves, spec)
    assert forward_only != trained
    assert "tanh_backward" in trained[0] and "tanh_backward" not in forward_only[0]
    # The hidden state requiring grad adds its gradient to the frozen layer's.
    hidden = torch.randn(2, HIDDEN, requires_grad=True)
    assert "tanh_backward" in program(frozen, *call_leaves(hidden, torch.randn(HIDDEN)))[0]
    # A layer whose weights require grad computes the hidden state's gradient
    # whether its own requires grad or not (as a scan's step does: the first
    # layer's input may not, the later layers' do), so that the first layer's
    # program is the others'.
    assert program(Scaled(), *call_leaves(hidden, torch.randn(HIDDEN))) == trained


class Recomputed(nn.Module):
    """A layer that recomputes its linear layer in the backward, as
    transformers' gradient checkpointing does (torch's checkpoint)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden):
        return torch.utils.checkpoint.checkpoint(self.linear, hidden, use_reentrant=False).tanh()


def test_a_layer_that_recomputes_in_its_backward_is_traced_on_its_fakes(device):
    # Its backward recomputes with the fakes, not with its own weights on the
    # device (which fakes on the CPU cannot mix with).
    layer = Recomputed().to(device)
    hidden = torch.randn(2, HIDDEN, device=device, requires_grad=True)
    code, constants = program(layer, *call_leaves(hidden))
    assert code.count("addmm") >= 2 and "tanh_backward" in code  # the recomputed linear
    assert program(Recomputed().to(device), *call_leaves(hidden)) == (code, constants)
