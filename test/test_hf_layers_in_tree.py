"""A converted model is still the user's model: each layer stays in the
module tree as itself, with the Parameters it had (leaf tensors, views of
the stacked storage), so an optimizer made before converting, freezing a
layer and per-layer param groups train as unconverted, while the layers
still run as one scan (layer_stack.storage, layer_stack.stacked_steps)."""
import copy
import sys

import pytest
import torch
import torch_xla
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import torch_xla_ext as tx
from torch_xla_ext.layer_stack import alike
from test_hf import batch, make_model
from tolerances import TRAINING, close


def test_the_module_tree_names_and_parameters_are_the_unconverted_ones():
    model = make_model(layers=4)
    layers = list(model.model.layers)
    params = dict(model.named_parameters())
    tx.stack_layers(model)
    assert [module for module in model.modules() if isinstance(module, LlamaDecoderLayer)] == layers
    assert all(model.model.layers[index] is layer and model.get_submodule(f"model.layers.{index}")
               is layer for index, layer in enumerate(layers))
    converted = dict(model.named_parameters())
    assert list(converted) == list(params)
    assert all(converted[name] is param and param.is_leaf for name, param in params.items())
    assert list(model.state_dict()) == [*params]


def steps(model, optimizer, device, count=3):
    losses = []
    for step in range(count):
        ids, mask = batch(device, seed=step)
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        losses.append(loss.item())
    return losses


def trained_pair(device, make_optimizer, prepare=lambda model: None, convert_after=False):
    """The unconverted and the converted model after the same steps, each with
    the optimizer `make_optimizer(model)`."""
    reference = make_model(layers=4).to(device)
    model = copy.deepcopy(reference)
    for each in (reference, model):
        prepare(each)
    if not convert_after:
        tx.stack_layers(model)
    optimizer = make_optimizer(model)
    if convert_after:  # the optimizer made before converting
        tx.stack_layers(model)
    expected = steps(reference, make_optimizer(reference), device)
    close(torch.tensor(steps(model, optimizer, device)), torch.tensor(expected), TRAINING)
    for (name, param), other in zip(model.named_parameters(), reference.parameters()):
        close(param, other, TRAINING, name)
    return reference, model


@pytest.mark.parametrize("kind", ["adamw", "sgd-momentum"])
def test_an_optimizer_made_before_converting_trains_as_unconverted(device, kind):
    make = ((lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2)) if kind == "adamw"
            else (lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)))
    trained_pair(device, make, convert_after=True)


def test_frozen_layers_stay_unchanged_and_the_others_train_as_unconverted(device):
    def freeze(model):
        for param in model.model.layers[0].parameters():
            param.requires_grad_(False)
        for layer in model.model.layers:
            layer.mlp.up_proj.weight.requires_grad_(False)

    before = make_model(layers=4).model.layers[0].self_attn.q_proj.weight.detach().clone()
    _, model = trained_pair(
        device, lambda model: torch.optim.AdamW(
            [param for param in model.parameters() if param.requires_grad], lr=1e-2), freeze)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight.cpu(), before)
    assert all(layer.mlp.up_proj.weight.grad is None for layer in model.model.layers)


def test_per_layer_param_groups_give_the_unconverted_updates(device):
    def layer_wise(model):  # learning-rate decay by layer, no weight decay on norms
        groups = [{"params": list(layer.parameters()), "lr": 1e-2 * 0.5 ** index}
                  for index, layer in enumerate(model.model.layers)]
        others = [param for name, param in model.named_parameters() if ".layers." not in name]
        return torch.optim.AdamW([*groups, {"params": others, "lr": 1e-2}], weight_decay=0.1)
    trained_pair(device, layer_wise)


def test_the_step_updates_the_stacked_tensors_which_the_layers_see(device):
    model = tx.stack_layers(make_model(layers=4)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps(model, optimizer, device, count=2)
    stacked = model.model.layers.segments[0].storage.stacked["self_attn.q_proj.weight"]
    for index, layer in enumerate(model.model.layers):
        weight = layer.self_attn.q_proj.weight
        assert torch._C._is_alias_of(weight, stacked)
        assert torch.equal(weight.cpu(), stacked[index].cpu())
    # The optimizer's state dict is the unconverted one: per layer Parameter.
    assert len(optimizer.state_dict()["state"]) == len(list(model.parameters()))


def test_the_layers_keep_their_values_through_a_compiled_function(device):
    # torch_xla's dynamo bridge clears every live tensor's pending IR after a
    # sync; the layers' views, made anew after it, must survive that.
    model = tx.stack_layers(make_model(layers=3)).to(device)
    expected = [param.detach().cpu() for param in model.model.layers.parameters()]
    compiled = torch.compile(lambda x: (x @ x).sum(), backend="openxla")
    compiled(torch.ones(4, 4, device=device))
    model.cpu()
    for param, value in zip(model.model.layers.parameters(), expected):
        assert torch.equal(param.detach(), value)


def test_the_layers_gradients_are_slices_of_one_stacked_gradient_freed_with_them(device):
    model = tx.stack_layers(make_model(layers=4)).to(device)
    storage = model.model.layers.segments[0].storage
    name = "mlp.up_proj.weight"
    ids, mask = batch(device, seed=0)
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    grads = [layer.mlp.up_proj.weight.grad for layer in model.model.layers]
    stacked_grad = storage.given_gradient(name)
    assert stacked_grad is not None and all(grad._base is stacked_grad for grad in grads)
    # Held by the layers' views alone, so that clearing them frees it.
    assert storage.stacked[name].grad is None
    torch_xla.sync()  # the views are set aside and made again
    again = [layer.mlp.up_proj.weight.grad for layer in model.model.layers]
    assert all(torch.equal(new.cpu(), old.cpu()) for new, old in zip(again, grads))
    # A second backward accumulates into what the layers hold, as unconverted.
    firsts = [grad.cpu() for grad in again]
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    for layer, first in zip(model.model.layers, firsts):
        close(layer.mlp.up_proj.weight.grad.cpu(), 2 * first, TRAINING)
    del grads, again, stacked_grad
    model.zero_grad()
    assert storage.given_gradient(name) is None and storage.stacked[name].grad is None


def logits_of(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits.cpu()


@pytest.mark.parametrize("convert", ["before", "after"])
def test_transformers_adapter_switches_reach_the_scan(device, convert):
    # transformers' adapter API walks the module tree and sets each LoRA
    # module's switches: the stacked layers read them again at the next call.
    from peft import LoraConfig

    ids, mask = batch(device)
    base = logits_of(make_model(layers=4).to(device), ids, mask)
    model = make_model(layers=4)
    if convert == "before":
        tx.stack_layers(model)
    model.add_adapter(LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                 init_lora_weights=False))
    if convert == "after":
        tx.stack_layers(model)
    model.to(device)
    with_adapter = logits_of(model, ids, mask)
    assert not torch.allclose(with_adapter, base, atol=1e-4)
    model.disable_adapters()
    close(logits_of(model, ids, mask), base, TRAINING)
    model.enable_adapters()
    close(logits_of(model, ids, mask), with_adapter, TRAINING)


def test_a_setting_changed_on_one_layer_is_honoured_and_a_new_module_refused(device):
    ids, mask = batch(device)
    reference = make_model(layers=4).to(device)
    model = tx.stack_layers(copy.deepcopy(reference))
    logits_of(model, ids, mask)  # planned with the settings as built
    for each in (reference, model):
        each.model.layers[2].self_attn.scaling = 0.05
    close(logits_of(model, ids, mask), logits_of(reference, ids, mask), TRAINING)
    model.model.layers[1].mlp.extra = torch.nn.Identity()
    with pytest.raises(ValueError, match="layer 1 of the stacked layers changed in structure"):
        logits_of(model, ids, mask)


def calls_of(function, run) -> int:
    """How many times `run()` calls `function` (a Python function)."""
    code, count = function.__code__, [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            count[0] += 1
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return count[0]


def test_a_planned_call_reads_no_layouts_until_a_setting_changes(device):
    ids, mask = batch(device)
    model = tx.stack_layers(make_model(layers=4)).to(device)
    logits_of(model, ids, mask)
    assert calls_of(alike.layout_of, lambda: logits_of(model, ids, mask)) == 0
    model.model.layers[0].self_attn.scaling = 0.05  # the template's setting, read again
    assert calls_of(alike.layout_of, lambda: logits_of(model, ids, mask)) > 0
    assert calls_of(alike.layout_of, lambda: logits_of(model, ids, mask)) == 0


def test_a_gradient_of_a_layer_run_as_itself_joins_the_scans_and_survives_a_sync(device):
    reference = make_model(layers=4).to(device)
    model = tx.stack_layers(copy.deepcopy(reference))
    ids, mask = batch(device)
    hidden = torch.randn(2, 8, 32, device=device)
    position = torch.arange(8, device=device).expand(2, -1)
    for each in (reference, model):
        embeddings = each.model.rotary_emb(hidden, position)
        # Layer 1 called by itself, outside the model's loop: its own gradient.
        each.model.layers[1](hidden, position_embeddings=embeddings)[0].sum().backward()
        each(ids, attention_mask=mask, labels=ids).loss.backward()
        torch_xla.sync()
    for name, param in reference.model.layers.named_parameters():
        close(model.model.layers.get_parameter(name).grad.cpu(), param.grad.cpu(), TRAINING, name)
