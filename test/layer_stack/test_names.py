"""A StackedList's layers under their own names: a single layer held as
itself, a pattern stacked by groups and a run stacked by layers, whose
state_dict, loading and parameters in the unconverted order are the
nn.ModuleList's, the layers' tensors views of the stacked ones."""
import copy

import pytest
import torch
from torch import nn

from torch_xla_ext.layer_stack import StackedList
from torch_xla_ext.layer_stack.segments import Segment


class Wide(nn.Module):
    """A norm, a linear layer with a bias, a buffer saved with it and one that is not."""

    def __init__(self):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(4), nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(1))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


class Narrow(nn.Module):
    """Another structure: a linear layer without a bias."""

    def __init__(self):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(4), nn.Linear(4, 4, bias=False)


class Gated(nn.Module):
    """A structure of its own, held as itself."""

    def __init__(self):
        super().__init__()
        self.linear, self.gate = nn.Linear(4, 4), nn.Linear(4, 1)


def layers() -> list[nn.Module]:
    """A layer alike to none, a pattern of two kinds twice, then a run of three."""
    torch.manual_seed(0)
    made = [Gated(), Wide(), Narrow(), Wide(), Narrow(), Wide(), Wide(), Wide()]
    with torch.no_grad():
        for layer in made:
            for tensor in (*layer.parameters(), *layer.buffers()):
                tensor.normal_()
    return made


def stack_and_list():
    """A StackedList and the nn.ModuleList of the same layers."""
    unconverted = nn.ModuleList(layers())
    return StackedList(copy.deepcopy(list(unconverted))), unconverted


def test_the_segments_store_a_single_layer_a_pattern_by_groups_and_a_run_by_layers():
    stack, _ = stack_and_list()
    assert stack.plan == (Segment(0, 1, 1), Segment(1, 2, 2), Segment(5, 1, 3))
    assert stack.segments[0] is stack[0]  # itself
    shapes = [{name: tuple(tensor.shape) for name, tensor in segment.storage.stacked.items()}
              for segment in stack.segments[1:]]
    assert shapes[0]["layers.0.linear.bias"] == (2, 4)  # position 0 of 2 groups
    assert shapes[0]["layers.1.linear.weight"] == (2, 4, 4)
    assert "layers.1.linear.bias" not in shapes[0]  # Narrow has none
    assert shapes[1]["linear.weight"] == (3, 4, 4)


def test_the_state_dict_has_the_lists_keys_in_its_order_and_values():
    stack, unconverted = stack_and_list()
    expected, saved = unconverted.state_dict(), stack.state_dict()
    assert list(saved) == list(expected)  # no non-persistent buffer
    assert "1.scratch" not in saved and "1.count" in saved
    for key, value in expected.items():
        assert torch.equal(saved[key], value), key
    # The modules' versions under the per-layer paths, none under the stored ones.
    assert {"3", "3.linear", "0.gate"} <= set(saved._metadata)
    assert not any(key.startswith("segments") for key in saved._metadata)
    # Nested in a model, the keys are the list's under its name.
    owner = nn.Module()
    owner.layers = stack
    assert list(owner.state_dict()) == [f"layers.{key}" for key in expected]


def test_the_parameters_are_the_lists_in_its_order_as_views_of_the_stacked_ones():
    stack, unconverted = stack_and_list()
    expected = dict(unconverted.named_parameters())
    params = dict(stack.named_parameters())
    assert list(params) == list(expected)
    for name, param in params.items():
        assert param.is_leaf and torch.equal(param, expected[name]), name
    stacked = stack.segments[2].storage.stacked["linear.weight"]
    assert torch._C._is_alias_of(params["6.linear.weight"], stacked)
    # An optimizer over named parameters saves the list's names.
    optimizer = torch.optim.SGD(stack.named_parameters(), lr=0.1)
    (group,) = optimizer.state_dict()["param_groups"]
    assert group["param_names"] == list(expected)


def test_an_unconverted_state_dict_loads_layer_by_layer():
    stack, _ = stack_and_list()
    other = nn.ModuleList(layers())
    with torch.no_grad():
        for tensor in other.state_dict().values():
            tensor.add_(1.0)
    assert not stack.load_state_dict(other.state_dict()).missing_keys
    for key, value in other.state_dict().items():
        assert torch.equal(stack.state_dict()[key], value), key
    assert torch.equal(stack[4].linear.weight, other[4].linear.weight)
    assert [type(layer) for layer in stack.unstacked()] == [type(layer) for layer in other]


def test_missing_keys_are_reported_per_layer_and_keep_their_values():
    stack, unconverted = stack_and_list()
    before = stack.state_dict()
    other = {key: value + 1.0 for key, value in unconverted.state_dict().items()}
    for key in ("3.linear.weight", "6.count", "0.gate.bias"):
        del other[key]
    result = stack.load_state_dict(other, strict=False)
    assert sorted(result.missing_keys) == ["0.gate.bias", "3.linear.weight", "6.count"]
    assert not result.unexpected_keys
    after = stack.state_dict()
    for key in ("3.linear.weight", "6.count", "0.gate.bias"):
        assert torch.equal(after[key], before[key]), key  # kept
    for key in ("1.linear.weight", "5.count", "0.gate.weight"):
        assert torch.equal(after[key], other[key]), key  # loaded, the slices beside too
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: .*3\.linear\.weight"):
        stack.load_state_dict(other)


def test_a_slice_of_another_shape_and_keys_of_no_layer_are_reported():
    stack, unconverted = stack_and_list()
    other = dict(unconverted.state_dict())
    other["4.linear.weight"] = torch.zeros(4, 5)
    with pytest.raises(RuntimeError, match=r"size mismatch for 4\.linear\.weight: copying a "
                                           r"param with shape torch\.Size\(\[4, 5\]\) from "
                                           r"checkpoint, the shape in current model is "
                                           r"torch\.Size\(\[4, 4\]\)"):
        stack.load_state_dict(other)
    other = {**unconverted.state_dict(), "8.linear.weight": torch.zeros(4, 4)}
    assert stack.load_state_dict(other, strict=False).unexpected_keys == ["8.linear.weight"]
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: "
                                           r"\"8\.linear\.weight\""):
        stack.load_state_dict(other)
