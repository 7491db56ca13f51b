"""Why layers cannot be stacked, as a value (`layer_stack.stacking_refusal`):
the checks the constructors raise from, asked before anything is built;
`stack_layers` reports them ("cannot stack the layers at ..."), while an error
raised by making a stack after them is a bug that reaches the user as it is,
and a wrong option is an argument error naming it."""
import re
import warnings

import pytest
import transformers
from torch import nn

import torch_xla_ext.layer_stack.stack as stack_module
from torch_xla_ext.hf import StackedLayers, UnstackedLayersWarning, stack_layers
from torch_xla_ext.layer_stack import LayerStack, Refusal, StackedList, stacking_refusal

SHARED_REASON = ("Layer 1 parameter '1.weight' is the same tensor as layer 0's '1.weight'; a "
                 "LayerStack stores one copy per layer and would untie them (a tensor every "
                 "layer of the segment holds stays one, but not one some of them share). Give "
                 "each layer its own parameters, or keep the shared one outside the layers.")


def block(linear=None):
    """A block: a module of two modules that hold tensors."""
    return nn.Sequential(nn.LayerNorm(4), linear or nn.Linear(4, 4))


def sharing_blocks(count=3):
    """Blocks whose second module is one Linear in the first two, each's own
    in the others: a parameter that some of the layers share."""
    shared = nn.Linear(4, 4)
    return [block(shared if index < 2 else None) for index in range(count)]


def closing_over_itself():
    """A block holding a function whose closure is the block itself, which a
    stack's copy of layer 0 would share rather than copy."""
    layer = block()
    layer.act = lambda x: layer(x)
    return layer


class TwoLists(nn.Module):
    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = nn.ModuleList(first), nn.ModuleList(second)

    def forward(self, x):
        for layer in (*self.first, *self.second):
            x = layer(x)
        return x


def llama(layers=2):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def test_a_parameter_shared_between_layers_is_a_refusal_of_the_segment():
    refusal = stacking_refusal(sharing_blocks())
    assert refusal == Refusal(f"layers 0-2 (3 layers): {SHARED_REASON}")
    # The constructors raise the same, a LayerStack without the segment.
    with pytest.raises(ValueError, match=re.escape(refusal.reason)):
        StackedList(sharing_blocks())
    with pytest.raises(ValueError, match=f"^{re.escape(SHARED_REASON)}$"):
        LayerStack(sharing_blocks())


@pytest.mark.parametrize("layers, error, reason", [
    ([closing_over_itself(), block()], ValueError,
     "Layer 0 setting 'act' refers to the layer's own module '' through a function's closure "
     "or defaults, which the stack's copy of layer 0 shares rather than copies"),
    ([block(), "not a layer"], TypeError,
     "Layer 1 is a str, not an nn.Module; pass a list or nn.ModuleList of layers."),
], ids=["setting-reaching-its-own-module", "not-a-module"])
def test_a_layer_no_stack_can_hold_is_a_refusal_of_the_list(layers, error, reason):
    refusal = stacking_refusal(layers)
    assert refusal.error is error and refusal.reason.startswith(reason)
    with pytest.raises(error, match=f"^{re.escape(refusal.reason)}$"):
        StackedList(layers)


def test_alike_layers_and_layers_built_otherwise_than_their_neighbours_are_not_refused():
    assert stacking_refusal([block() for _ in range(3)]) is None
    # Layers not alike are stored in segments (one by one here), not refused; a
    # LayerStack, whose layers must all be alike, refuses them.
    unlike = [block(), nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), block()]
    assert stacking_refusal(unlike) is None
    assert len(StackedList(unlike).plan) == 3
    with pytest.raises(ValueError, match=r"Layer 1 differs from layer 0: it "):
        LayerStack(unlike)


def test_the_refusal_is_known_without_building_a_stack(monkeypatch):
    monkeypatch.setattr(stack_module, "_meta_copy", _raise_bug)
    assert stacking_refusal([block() for _ in range(3)]) is None
    assert stacking_refusal(sharing_blocks()).reason.endswith(SHARED_REASON)


def _raise_bug(*args, **kwargs):
    raise ValueError("bug")


def test_an_error_while_making_a_stack_is_not_a_refusal(monkeypatch):
    monkeypatch.setattr(stack_module, "_meta_copy", _raise_bug)
    with pytest.raises(ValueError, match="^bug$"):
        StackedList([block() for _ in range(3)])
    model = llama()
    with pytest.raises(ValueError, match="^bug$"):
        stack_layers(model, path="model.layers")
    # Without a path, too: not a warning that leaves the list as it was.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnstackedLayersWarning)
        with pytest.raises(ValueError, match="^bug$"):
            stack_layers(model)
    assert type(model.model.layers) is nn.ModuleList


def test_stack_layers_reports_a_refusal_and_leaves_the_model_unchanged():
    model = llama(layers=3)
    layers = model.model.layers
    layers[1].mlp.up_proj.weight = layers[0].mlp.up_proj.weight
    with pytest.raises(ValueError, match=re.escape(
            "stack_layers: cannot stack the layers at 'model.layers': layers 0-2 (3 layers): "
            "Layer 1 parameter 'mlp.up_proj.weight' is the same tensor as layer 0's "
            "'mlp.up_proj.weight'; a LayerStack stores one copy per layer")):
        stack_layers(model)
    assert model.model.layers is layers


def test_a_block_that_some_groups_of_layers_share_is_refused_naming_the_layers():
    # Layers 2-7 repeat a group of two, whose first layer holds a block that
    # the first two groups share: the refusal names layers, not groups. (A
    # block every group holds stays one: test_hf_hybrid_patterns.py, Zamba.)
    shared = nn.Linear(4, 4)
    layers = [nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(2)]
    layers += [each for group in range(3) for each in (block(shared if group < 2 else None),
                                                       nn.Sequential(nn.Linear(4, 4),
                                                                     nn.Linear(4, 4)))]
    refusal = stacking_refusal(layers)
    assert refusal.reason.startswith(
        "layers 2-7 (3 groups of 2 layers): Layer 4 parameter '1.weight' is the same tensor as "
        "layer 2's '1.weight'; a LayerStack stores one copy per layer")


def test_a_refused_list_among_others_stays_with_a_warning():
    model = TwoLists(sharing_blocks(), [block() for _ in range(3)])
    with pytest.warns(UnstackedLayersWarning) as caught:
        stack_layers(model)
    (message,) = [str(each.message) for each in caught]
    assert message == (f"stack_layers: cannot stack the layers at 'first': layers 0-2 "
                       f"(3 layers): {SHARED_REASON}; they stay as they were, and the model's "
                       f"other layer lists are stacked.")
    assert type(model.first) is nn.ModuleList and type(model.second) is StackedLayers

    model = TwoLists([closing_over_itself(), block()], [block(), block()])
    with pytest.raises(ValueError, match=r"^stack_layers: cannot stack the layers at 'first': "
                                         r"Layer 0 setting 'act' refers to the layer's own "):
        stack_layers(model, path="first")


@pytest.mark.parametrize("options, error, message", [
    (dict(unroll=0), ValueError, "unroll must be 1 or more steps per loop iteration, got 0"),
    (dict(unroll="2"), TypeError, "unroll must be an int (steps per loop iteration)"),
    (dict(partition_fn="save_some"), ValueError, "unknown policy 'save_some'"),
    (dict(unrol=2), TypeError, "unknown option 'unrol'; the options are partition_fn, "),
], ids=["unroll-0", "unroll-str", "policy", "unknown-option"])
def test_a_wrong_option_is_an_argument_error_naming_it(options, error, message):
    model = llama()
    layers = model.model.layers
    with pytest.raises(error, match=f"^stack_layers: {re.escape(message)}"):
        stack_layers(model, **options)
    assert model.model.layers is layers
    with pytest.raises(error, match=f"^stacking_refusal: {re.escape(message)}"):
        stacking_refusal([block(), block()], **options)
    with pytest.raises(error, match=f"^StackedList: {re.escape(message)}"):
        StackedList([block()], **options)
