"""Layers of several kinds in one scan (layer_stack.kinds): the settings that
tell kinds apart, the proof that one trace stands for every kind, and
per-layer arguments, against the for loop."""
import re
import warnings

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
from torch import nn

from torch_xla_ext.layer_stack import LayerByLayerWarning, LayerStack
from torch_xla_ext.layer_stack.kinds import (
    KindCalls, KindsCompared, PerLayerChoice, compare_kinds, kind_attributes, program_difference)
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
            output = output * torch.tensor(float(self.window))
        return _hand_on(output, window=self.window)


def _hand_on(output, **ignored):
    return output


@pytest.fixture(scope="module")
def device():
    return torch_xla.device()


def test_kind_attributes_are_what_differs_between_kinds():
    layers = [Scaled(window=4), Scaled(), Scaled(window=4), Scaled()]
    assert kind_attributes(layers, ["a", "b", "a", "b"], ("layer_idx",)) == {"window"}
    assert kind_attributes(layers, ["a", "b", "a", "b"], ("window",)) == set()
    layers[3].window = 2
    with pytest.raises(ValueError, match=r"Layer 3 setting 'window' differs from layer 1's, "
                                         r"the first layer of the same kind 'b'"):
        kind_attributes(layers, ["a", "b", "a", "b"], ())


class Gated(Scaled):
    """A layer of another structure: a submodule more than Scaled."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, HIDDEN)


def test_kinds_compared_differ_in_settings_or_in_structure():
    kinds = ["a", "b", "a", "b"]
    assert compare_kinds([Scaled(window=4), Scaled()] * 2, kinds) == KindsCompared(
        frozenset({"window"}))
    compared = compare_kinds([Scaled(), Gated()] * 2, kinds)
    assert compared.settings == frozenset()
    assert re.match(r"Layer 1 differs from layer 0: it has extra submodules \['gate'\]",
                    compared.structure)
    # Layers of one kind not alike are no structure of the kinds: the stack says so.
    layers = [Scaled(), Scaled(), Gated(), Scaled()]
    assert compare_kinds(layers, kinds).structure is None
    with pytest.raises(ValueError, match=r"Layer 2 differs from layer 0: it has extra submodules"):
        LayerStack(layers)
    with pytest.raises(ValueError, match=r"the layers' kinds \['a', 'b'\] differ in more than "
                                         r"their settings \(Layer 1 differs from layer 0"):
        kind_attributes([Scaled(), Gated()] * 2, kinds, ())


def test_the_proof_tells_a_setting_handed_on_from_one_that_computes():
    hidden, scale = torch.randn(2, HIDDEN), torch.randn(HIDDEN)
    tensors = {name: tensor.unsqueeze(0) for name, tensor in Scaled().state_dict().items()}
    # Only handed on: one trace stands for both kinds.
    assert program_difference([Scaled(window=4), Scaled()], tensors, hidden, (scale,), {}) is None
    # Read into a constant the layer makes: the constants differ.
    difference = program_difference([Scaled(window=4, uses_window=True),
                                     Scaled(window=2, uses_window=True)],
                                    tensors, hidden, (scale,), {})
    assert difference == ("the layer computes another graph with the settings of its kind 1 "
                          "than with those of its kind 0")
    # Read to branch: the graphs differ.
    assert program_difference([Scaled(window=4, uses_window=True), Scaled(uses_window=True)],
                              tensors, hidden, (scale,), {}) is not None


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


def test_kind_calls_record_each_kind_once_and_refuse_another_kinds_arguments():
    calls = KindCalls(["a", "a", "b", "a"])
    hidden, first, second = object(), torch.ones(1), torch.zeros(1)
    assert [calls.record(0, hidden, (first,), {}), calls.record(1, hidden, (first,), {}),
            calls.record(2, hidden, (second,), {})] == [False, False, True]
    args, kwargs = calls.merged(calls.calls())
    assert kwargs == {} and args[0].variants == (first, second)
    assert args[0].choice == (0, 0, 1, 0)
    output = calls.ran(object())
    with pytest.raises(ValueError, match=r"layer 3 is called with other arguments than layer "
                                         r"0, the first layer of its kind: its argument "
                                         r"args\[0\] is not the one layer 0 got"):
        calls.record(3, output, (second,), {})
    # Work between two layers on the hidden state would not run inside the scan.
    with pytest.raises(RuntimeError, match="layer 3 got another hidden state than layer 2 "
                                           "returned"):
        calls.record(3, object(), (first,), {})
    with pytest.raises(RuntimeError, match="layer 1 got another hidden state than layer 0"):
        calls.record(0, hidden, (first,), {})
        calls.record(1, object(), (first,), {})
