"""A stacked layer as code outside its owner's forward addresses it
(`layers[3]`, `get_submodule`, iteration): the layer itself, which reads
and runs as the layer, and whose hook registrations raise a ValueError
saying that the hook would never run, where they used to be dropped
without a word; a layer held as itself is the module that runs."""
import copy

import pytest
import torch
import torch_xla
from torch import nn

import torch_xla_ext as tx
from layer_calls import HIDDEN, Block, Loop, converted
from test_hf import make_model
from tolerances import SAME_OPS, close
from torch_xla_ext.layer_stack import LayerStack, StackedList

REGISTRATIONS = {
    "register_forward_hook": lambda module, *args: None,
    "register_forward_pre_hook": lambda module, args: None,
    "register_full_backward_hook": lambda module, grad_in, grad_out: None,
    "register_full_backward_pre_hook": lambda module, grad_out: None,
}


@pytest.mark.parametrize("registration", sorted(REGISTRATIONS))
def test_a_hook_on_a_converted_layer_or_its_submodule_is_refused_naming_it(registration):
    model = tx.stack_layers(make_model())
    hooks_before = hook_count(model)
    for module, named in ((model.model.layers[3], "layer 3 of"),
                          (model.get_submodule("model.layers.1.mlp"), "layer 1's mlp of")):
        with pytest.raises(ValueError, match=rf"^{named} the stacked layers runs inside a scan "
                                             rf".*would never run"):
            getattr(module, registration)(REGISTRATIONS[registration])
    assert hook_count(model) == hooks_before


def hook_count(model: nn.Module) -> int:
    return sum(len(hooks) for module in model.modules()
               for hooks in (module._forward_hooks, module._forward_pre_hooks,
                             module._backward_hooks, module._backward_pre_hooks))


def test_an_addressed_layer_still_reads_and_runs_as_the_layer():
    device = torch_xla.device()
    model = make_model()
    reference = copy.deepcopy(model.model.layers[2]).to(device)
    tx.stack_layers(model).to(device)
    layer = model.model.layers[2]
    assert type(layer) is type(reference) and layer.self_attn.layer_idx == 2
    assert type(layer.mlp.down_proj) is nn.Linear
    hidden = torch.randn(1, 5, 32, device=device)
    position = model.model.rotary_emb(hidden, torch.arange(5, device=device)[None])
    close(layer(hidden, position_embeddings=position),
          reference(hidden, position_embeddings=position), SAME_OPS)


def test_a_layer_stack_item_refuses_hooks_too():
    torch.manual_seed(0)
    stack = LayerStack([nn.Linear(4, 4) for _ in range(3)])
    with pytest.raises(ValueError, match="^layer 2 of the stacked layers runs inside a scan"):
        stack[-1].register_forward_hook(lambda *args: None)


class Wide(Block):
    def __init__(self):
        super().__init__()
        self.other = nn.Linear(HIDDEN, HIDDEN)


def test_a_layer_held_as_itself_is_the_module_that_runs_and_its_hook_runs():
    torch.manual_seed(0)
    reference, model = converted(Loop(StackedList([Block(), Wide(), Block()])),
                                 torch_xla.device())
    layer = model.blocks[1]  # alike to neither neighbour: held as itself
    assert layer is model.blocks[1]
    seen = []
    handle = layer.register_forward_hook(lambda module, args, output: seen.append(output))
    x = torch.randn(2, HIDDEN, device=torch_xla.device())
    close(model(x), reference(x), SAME_OPS)
    handle.remove()
    assert len(seen) == 1


@pytest.mark.parametrize("edit", [
    lambda layers, new: layers.__setitem__(1, new),
    lambda layers, new: layers.__delitem__(1),
    lambda layers, new: layers.append(new),
    lambda layers, new: layers.insert(0, new),
    lambda layers, new: layers.extend([new]),
    lambda layers, new: setattr(layers, "1", new),
], ids=["setitem", "delitem", "append", "insert", "extend", "setattr"])
def test_replacing_adding_or_deleting_a_layer_is_refused_and_changes_nothing(edit):
    model = tx.stack_layers(make_model())
    before = dict(model.state_dict())
    with pytest.raises(TypeError, match="stored stacked, and replacing, adding or deleting one is "
                                        "not supported.*unstack_layers"):
        edit(model.model.layers, copy.deepcopy(make_model().model.layers[0]))
    assert len(model.model.layers) == 4 and list(model.state_dict()) == list(before)


def test_a_copy_of_an_addressed_layer_is_a_module_of_its_own_that_takes_hooks():
    model = tx.stack_layers(make_model())
    with torch.inference_mode():  # views without gradients, which deepcopy takes
        copied = copy.deepcopy(model.model.layers[1])
    handle = copied.mlp.register_forward_hook(lambda *args: None)
    assert list(copied.mlp._forward_hooks) == [handle.id]
