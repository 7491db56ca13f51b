"""A stacked layer as code outside its owner's forward addresses it
(`layers[3]`, `get_submodule`, iteration): the layer itself, which reads
and runs as the layer. A hook on it, or on one of its submodules, makes it
run as itself, outside the scans, so that the hook runs as unconverted,
with that layer's values, as does a tensor hook on one of its Parameters;
removing the hook lets it scan again. A
LayerStack, which scans every layer, refuses the hook, saying why."""
import copy

import pytest
import torch
import torch_xla
from torch import nn

import torch_xla_ext as tx
from layer_calls import HIDDEN, Block, Loop, converted, forward_with_warnings
from test_hf import batch, make_model
from tolerances import SAME_OPS, TRAINING, close
from torch_xla_ext.layer_stack import LayerStack, StackedList


def recorder(seen: list, registration: str):
    """A hook for `registration` that appends the tensors it sees to `seen`."""
    def first(values):
        values = values if isinstance(values, tuple) else (values,)
        return next(value for value in values if isinstance(value, torch.Tensor))
    return {
        "register_forward_hook": lambda module, args, output: seen.append(first(output)),
        "register_forward_pre_hook": lambda module, args: seen.append(first(args)),
        "register_full_backward_hook":
            lambda module, grad_in, grad_out: seen.append(first(grad_out)),
        "register_full_backward_pre_hook": lambda module, grad_out: seen.append(first(grad_out)),
    }[registration]


def converted_llama():
    """A small Llama and a converted copy of it, both on the device, and a batch of ids."""
    device = torch_xla.device()
    reference = make_model().to(device)
    model = tx.stack_layers(make_model()).to(device)
    return reference, model, batch(device)[0]


REGISTRATIONS = ("register_forward_hook", "register_forward_pre_hook",
                 "register_full_backward_hook", "register_full_backward_pre_hook")


@pytest.mark.parametrize("registration", REGISTRATIONS)
@pytest.mark.parametrize("where", ["model.layers.3", "model.layers.1.mlp"])
def test_a_hook_on_a_converted_layer_or_its_submodule_runs_with_its_values(registration,
                                                                            where):
    reference, model, ids = converted_llama()
    seen = {}
    handles = [each.get_submodule(where).__getattribute__(registration)(
        recorder(seen.setdefault(name, []), registration))
        for name, each in (("reference", reference), ("converted", model))]
    for each in (reference, model):
        each(ids, labels=ids).loss.backward()
    torch_xla.sync()
    assert len(seen["converted"]) == len(seen["reference"]) == 1
    close(seen["converted"], seen["reference"], TRAINING)
    close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()],
          TRAINING)
    # The other layers still scan; with the hook removed, all of them do again.
    assert hlo_whiles(model, ids) == 1
    for handle in handles:
        handle.remove()
    seen["converted"].clear()
    assert hlo_whiles(model, ids) == 1 and not model.model.layers.hooked_layers()
    assert seen["converted"] == []


def hlo_whiles(model: nn.Module, ids) -> int:
    """The While loops of a forward's graph."""
    logits = model(ids).logits
    return torch_xla._XLAC._get_xla_tensors_hlo([logits]).count(" while(")


@pytest.mark.parametrize("registration", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_tensor_hook_on_a_layers_parameter_runs_with_its_gradient(registration):
    reference, model, ids = converted_llama()
    seen = {}
    for name, each in (("reference", reference), ("converted", model)):
        weight = each.model.layers[2].self_attn.q_proj.weight
        getattr(weight, registration)(
            lambda tensor, name=name: seen.setdefault(name, []).append(
                tensor.grad.clone() if registration.endswith("grad_hook") else tensor.clone()))
        each(ids, labels=ids).loss.backward()
    assert len(seen["converted"]) == len(seen["reference"]) == 1
    close(seen["converted"], seen["reference"], TRAINING)
    close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()],
          TRAINING)
    assert model.model.layers.hooked_layers() == (2,) and hlo_whiles(model, ids) == 1


def test_hooks_on_every_layer_run_each_layer_as_itself_as_often_as_unconverted():
    # transformers' gradient-checkpointing tests count a layer's calls by a hook on each.
    reference, model, ids = converted_llama()
    counts = {}
    for name, each in (("reference", reference), ("converted", model)):
        for layer in each.model.layers:
            layer.register_forward_hook(
                lambda module, args, output, name=name: counts.__setitem__(
                    name, counts.get(name, 0) + 1))
        each(ids)
    assert counts == {"reference": 4, "converted": 4}
    assert model.model.layers.hooked_layers() == (0, 1, 2, 3)


def test_a_hook_made_before_stacking_runs_on_its_layer_alone_and_the_rest_scan():
    torch.manual_seed(0)
    device = torch_xla.device()
    blocks = nn.ModuleList([Block() for _ in range(4)])
    seen = []  # the copy `converted` makes shares the hook, and so the list
    blocks[0].register_forward_hook(lambda module, args, output: seen.append(output))
    reference, model = converted(Loop(blocks), device)
    x = torch.randn(2, HIDDEN, device=device)
    output, loops, warned = forward_with_warnings(model, x)
    close(output, reference(x), SAME_OPS)
    assert len(seen) == 2 and loops == 1 and not warned  # layer 0 as itself, 1-3 one scan
    close(seen[0], seen[1], SAME_OPS)
    assert model.blocks.hooked_layers() == (0,) and not model.blocks.stacks()[0].template \
        ._forward_hooks  # the template runs layers 1-3: layer 0's hook is no part of it
    model.blocks[0]._forward_hooks.clear()
    assert model.blocks.hooked_layers() == ()


def test_a_copy_of_a_converted_model_keeps_watching_its_layers_hooks():
    model = tx.stack_layers(make_model())
    model.model.layers[2].register_forward_hook(lambda *args: None)
    copied = copy.deepcopy(model)
    assert copied.model.layers.hooked_layers() == (2,)
    copied.model.layers[0].register_forward_pre_hook(lambda *args: None)
    assert copied.model.layers.hooked_layers() == (0, 2)
    assert model.model.layers.hooked_layers() == (2,)


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


def test_a_layer_stack_item_refuses_hooks_naming_it():
    torch.manual_seed(0)
    stack = LayerStack([nn.Linear(4, 4) for _ in range(3)])
    for registration in REGISTRATIONS:
        with pytest.raises(ValueError, match="^layer 2 of the stacked layers runs inside a scan "
                                             ".*would never run"):
            getattr(stack[-1], registration)(lambda *args: None)
    assert not stack[2]._forward_hooks


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
