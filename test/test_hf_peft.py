"""stack_layers on peft's LoRA models (get_peft_model first, then stack_layers),
against the same peft model unconverted."""
import copy
import warnings

import pytest
import torch
import torch_xla
from support import supports
import per_layer
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

from test_hf import batch, make_model, per_layer_grads
from tolerances import THROUGH_LAYERS, TRAINING, close, close_by_name
from torch_xla_ext.hf import StackedLayers, stack_layers
from torch_xla_ext.layer_stack import LayerByLayerWarning
from torch_xla_ext.layer_stack.segments import Segment

LAYERS = 2
Q_AND_V = dict(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def peft_model(seed=0, layers=LAYERS, **config):
    """A LoRA model of a small Llama whose adapters all compute something
    (peft starts lora_B at zero)."""
    model = get_peft_model(make_model(layers=layers), LoraConfig(**config))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    return model


def peft_pair(**config):
    reference = peft_model(**config)
    return reference, stack_layers(copy.deepcopy(reference))


def stacked(model) -> StackedLayers:
    return model.base_model.model.model.layers


def stacked_tensors(model) -> torch.nn.Module:
    """The stacked tensors of a model whose layers are one segment, one run of alike layers."""
    stack = stacked(model)
    assert stack.plan == (Segment(0, 1, len(stack)),)
    return per_layer.stacked_tensors(stack.segments[0])


@pytest.mark.parametrize("config", [
    Q_AND_V,
    dict(r=4, target_modules="all-linear", modules_to_save=["lm_head"], lora_dropout=0.0),
], ids=["q-and-v", "all-linear-and-lm_head"])
@supports("LoRA", "llama")
def test_training_is_one_scan_with_the_unconverted_losses_and_adapter_gradients(device, config):
    reference, model = peft_pair(**config)
    assert type(stacked(model)) is StackedLayers
    assert not stacked_tensors(model).self_attn.q_proj.base_layer.weight.requires_grad
    assert stacked(model)[1].self_attn.q_proj.kwargs["target_name"] == (
        "model.layers.1.self_attn.q_proj")
    ids, mask = batch(device)
    results = []
    for which in (reference, model):
        which.to(device).train()
        optimizer = torch.optim.AdamW([p for p in which.parameters() if p.requires_grad], lr=1e-2)
        steps = []
        for step in range(3):
            optimizer.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("error", LayerByLayerWarning)
                loss = which(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            if step == 0:
                hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss])
                assert ("while" in hlo) == (which is model)
            steps.append((loss.detach(), {name: grad.detach().clone()
                                          for name, grad in per_layer_grads(which).items()}))
            optimizer.step()
            torch_xla.sync()
        results.append(steps)
    for (reference_loss, reference_grads), (loss, grads) in zip(*results):
        close(loss, reference_loss, TRAINING)
        assert grads.keys() == reference_grads.keys()
        assert all("lora_" in name or "modules_to_save" in name for name in grads)
        for name, grad in reference_grads.items():
            close(grads[name], grad, THROUGH_LAYERS)


def test_lora_dropout_draws_a_mask_per_layer_inside_the_scan(device):
    model = stack_layers(peft_model(r=4, target_modules=["v_proj"], lora_dropout=0.5))
    model.to(device).train()
    ids, _ = batch(device)
    # One token (whose attention output is its value): lora_A's gradient is
    # zero exactly in the input features its layer's dropout mask dropped.
    logits = model(input_ids=ids[:1, :1]).logits
    logits.square().mean().backward()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([logits])
    grad = torch.stack([layer.self_attn.v_proj.lora_A.default.weight.grad
                        for layer in stacked(model)]).cpu()
    assert "while" in hlo and torch.isfinite(grad).all()
    kept = grad.abs().sum(dim=1) != 0  # [layers, input features]
    assert all(0.2 < fraction < 0.8 for fraction in kept.float().mean(dim=1).tolist())
    assert not torch.equal(kept[0], kept[1])


def test_save_pretrained_and_merge_and_unload_give_the_unconverted_results(device, tmp_path):
    reference, model = peft_pair(**Q_AND_V)
    reference.save_pretrained(tmp_path / "reference")
    model.save_pretrained(tmp_path / "converted")
    expected = load_file(tmp_path / "reference" / "adapter_model.safetensors")
    saved = load_file(tmp_path / "converted" / "adapter_model.safetensors")
    assert list(saved) == list(expected) and len(saved) == 4 * LAYERS
    for key, value in expected.items():
        assert torch.equal(saved[key], value), key
    assert type(stacked(model)) is StackedLayers  # the stack is back after saving
    loaded = PeftModel.from_pretrained(make_model(layers=LAYERS), tmp_path / "converted")
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key

    ids, mask = batch(device)
    logits = []
    for which in (reference, model):
        merged = which.merge_and_unload().to(device).eval()
        with torch.no_grad():
            logits.append(merged(input_ids=ids, attention_mask=mask).logits)
        torch_xla.sync()
    merged_layers = merged.model.layers
    assert type(merged_layers) is StackedLayers
    assert type(merged_layers[0].self_attn.q_proj) is torch.nn.Linear
    assert not any("lora" in name for name in merged.state_dict())
    close(logits[1], logits[0], THROUGH_LAYERS)


def dropout_of_layer_2(p: float):
    def change(model):
        model.base_model.model.model.layers[2].self_attn.v_proj.lora_dropout.default.p = p
    return change


@pytest.mark.parametrize("config, change, segments, kinds, scanned", [
    # Layer 2's adapter of another rank: another structure, a segment of its own.
    (dict(rank_pattern={"layers.2.self_attn.q_proj": 8}), None,
     (Segment(0, 1, 2), Segment(2, 1, 1)), (0, 0, 1), [(0, 2)]),
    # Another scaling: one storage, another kind, whose scaling (a number of
    # the adapter's arithmetic) is a per-layer operand of one scan.
    (dict(alpha_pattern={"layers.2.self_attn.q_proj": 32}), None,
     (Segment(0, 1, 3),), (0, 0, 1), [(0, 3)]),
    # Another dropout probability: another kind, but in evaluation no dropout
    # runs, so the three layers compute the same and are one scan.
    (dict(lora_dropout=0.1), dropout_of_layer_2(0.2), (Segment(0, 1, 3),), (0, 0, 1), [(0, 3)]),
], ids=["rank", "alpha", "dropout"])
def test_layers_whose_lora_settings_differ_run_as_runs_of_alike_layers(
        device, monkeypatch, config, change, segments, kinds, scanned):
    reference = peft_model(layers=3, **{**Q_AND_V, **config})
    if change is not None:
        change(reference)
    model = stack_layers(copy.deepcopy(reference))
    assert stacked(model).plan == segments and stacked(model).kinds == kinds
    runs = []
    scan_run = StackedLayers.scan_run
    monkeypatch.setattr(StackedLayers, "scan_run", lambda stack, run, *args: (
        runs.append((run.start, run.stop)), scan_run(stack, run, *args))[1])
    ids, mask = batch(device)
    logits = []
    for which in (reference, model):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", LayerByLayerWarning)
            logits.append(which.to(device).eval()(input_ids=ids, attention_mask=mask).logits)
    assert runs == scanned
    close(logits[1], logits[0], THROUGH_LAYERS)


def test_stack_layers_first_gives_the_same_model(device, tmp_path):
    # get_peft_model(stack_layers(model)), and an adapter loaded into a stacked
    # base model, as stack_layers(get_peft_model(model)).
    reference, model = peft_pair(**Q_AND_V)
    torch.manual_seed(0)
    adapted_after = get_peft_model(stack_layers(make_model(layers=LAYERS)), LoraConfig(**Q_AND_V))
    assert type(stacked(adapted_after)) is StackedLayers
    assert not stacked_tensors(adapted_after).self_attn.q_proj.base_layer.weight.requires_grad
    assert [name for name, p in adapted_after.named_parameters() if p.requires_grad] == [
        name for name, p in model.named_parameters() if p.requires_grad]
    reference.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(stack_layers(make_model(layers=LAYERS)), tmp_path,
                                       is_trainable=True)
    assert type(stacked(loaded)) is StackedLayers
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    # A second adapter loaded into the stacked model is there, stacked.
    loaded.load_adapter(tmp_path, adapter_name="second")
    assert type(stacked(loaded)) is StackedLayers
    assert stacked_tensors(loaded).self_attn.q_proj.lora_A.second.weight.shape == (LAYERS, 4, 32)
    ids, mask = batch(device)
    losses = []
    for which in (reference, loaded):
        which.to(device).train()
        loss = which(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        losses.append((loss, per_layer_grads(which)))
        torch_xla.sync()  # one graph for the loss and every gradient
    (reference_loss, reference_grads), (loss, grads) = losses
    close(loss, reference_loss, TRAINING)
    close_by_name(grads, reference_grads, THROUGH_LAYERS)


def test_disable_adapter_and_set_adapter_reach_the_stacked_layers(device, tmp_path):
    # As TRL's DPO does with a LoRA model: the reference logits with the
    # adapters off, then the policy's loss; and switching between two adapters.
    reference, model = peft_pair(**Q_AND_V)
    peft_model(seed=1, **Q_AND_V).save_pretrained(tmp_path)
    ids, mask = batch(device)
    results = []
    for which in (reference, model):
        which.load_adapter(tmp_path, adapter_name="other")
        which.to(device).train()
        optimizer = torch.optim.SGD([p for p in which.parameters() if p.requires_grad], lr=1.0)
        logits = {}
        with torch.no_grad(), which.disable_adapter():
            assert which.get_model_status().enabled is False
            logits["off"] = which(input_ids=ids, attention_mask=mask).logits
        assert which.get_model_status().enabled is True
        loss = which(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        grads = {name: grad.clone() for name, grad in per_layer_grads(which).items()}
        optimizer.step()  # the optimizer made before set_adapter still holds the parameters
        which.set_adapter("other")
        with torch.no_grad():
            logits["other"] = which(input_ids=ids, attention_mask=mask).logits
        which.set_adapter("default")
        with torch.no_grad():
            logits["default"] = which(input_ids=ids, attention_mask=mask).logits
        results.append((logits, loss, grads))
        torch_xla.sync()  # the logits, loss and gradients in one graph, not one each
        status = {layer.name: layer.requires_grad for layer in which.get_layer_status()}
        assert status["model.model.layers.1.self_attn.q_proj"] == {
            "default": True, "other": False}
    (reference_logits, reference_loss, reference_grads), (logits, loss, grads) = results
    for key, value in reference_logits.items():
        close(logits[key], value, THROUGH_LAYERS)
    assert not torch.allclose(logits["off"].cpu(), logits["default"].cpu(), atol=1e-3)
    assert not torch.allclose(logits["other"].cpu(), logits["default"].cpu(), atol=1e-3)
    close(loss, reference_loss, TRAINING)
    assert grads.keys() == reference_grads.keys() and all("default" in name for name in grads)
    for name, grad in reference_grads.items():
        close(grads[name], grad, THROUGH_LAYERS)
    layers = stacked_tensors(model).self_attn.q_proj
    assert layers.lora_A.default.weight.requires_grad
    assert not layers.lora_A.other.weight.requires_grad
    assert not layers.base_layer.weight.requires_grad


def test_delete_adapter_removes_it_from_the_stacked_layers(tmp_path):
    _, model = peft_pair(**Q_AND_V)
    peft_model(seed=1, **Q_AND_V).save_pretrained(tmp_path)
    model.load_adapter(tmp_path, adapter_name="other")
    model.delete_adapter("other")
    assert type(stacked(model)) is StackedLayers
    assert not any("other" in name for name in model.state_dict())


PEFT_IMPORTED_AFTER = """
import sys, torch, transformers
import torch_xla_ext as tx
torch.manual_seed(0)
model = tx.stack_layers(transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2)))
assert "peft" not in sys.modules, "stack_layers imported peft"
from peft import LoraConfig, get_peft_model
adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
print(type(adapted.base_model.model.model.layers).__name__,
      sorted(name for name, p in adapted.named_parameters() if p.requires_grad))
"""


def test_peft_imported_after_stack_layers_is_taught_then(run_isolated):
    # stack_layers does not import peft (seconds) for users who do not use it.
    result = run_isolated(PEFT_IMPORTED_AFTER)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("StackedLayers ['base_model.model.model.layers.0."
                                    "self_attn.q_proj.lora_A.default.weight'"), result.stdout


def test_the_adapter_state_dict_is_the_unconverted_ones():
    # peft picks an adapter's entries by visiting its adapted modules (also behind
    # transformers' get_adapter_state_dict and accelerate's saving); it found none.
    from peft import get_peft_model_state_dict

    reference, model = peft_pair(**Q_AND_V)
    expected, found = get_peft_model_state_dict(reference), get_peft_model_state_dict(model)
    assert len(expected) == 4 * LAYERS and list(found) == list(expected)
    close_by_name(found, expected, TRAINING)
