"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) under stack_layers,
with each experts implementation transformers offers: `batched_mm` (static
shapes) trains as one scan, with the router logits (output_router_logits) as
its per-layer outputs; the others route tokens by data, so the layers run one
by one and the warning says why and which setting scans."""
import copy
import warnings

import pytest
import torch
import torch_xla
import transformers

from support import supports
from test_hf import VOCAB, assert_one_scan_with_the_unconverted_step, batch, per_layer_grads
from tolerances import TRAINING, close
from torch_xla_ext.hf import StackedLayers, stack_layers
from torch_xla_ext.layer_stack import LayerByLayerWarning

COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, use_cache=False)
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                       num_experts_per_tok=2, head_dim=8)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                       num_experts_per_tok=2, shared_expert_intermediate_size=32)),
}


def moe_pair(family: str, experts_implementation: str, **config):
    """An unconverted MoE model with this experts implementation and a converted copy."""
    config_class, model_class, settings = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class._from_config(config_class(**COMMON, **{**settings, **config}),
                                     experts_implementation=experts_implementation)
    return model, stack_layers(copy.deepcopy(model))


@supports("training", FAMILIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_mm_experts_train_as_one_scan(device, family):
    reference, model = moe_pair(family, "batched_mm")
    assert isinstance(model.model.layers, StackedLayers)
    assert_one_scan_with_the_unconverted_step(reference, model, device)


def training_step(model, device, **call):
    ids, mask = batch(device)
    model.to(device).train()
    output = model(ids, attention_mask=mask, labels=ids, **call)
    output.loss.backward()
    return output, per_layer_grads(model)


def test_eager_experts_run_layer_by_layer_saying_which_setting_scans(device):
    # Two experts, and the loss alone (the layer-by-layer path's gradients are
    # tested with caches): eager routing syncs and compiles a graph for each
    # expert of each layer.
    reference, model = moe_pair("mixtral", "eager", num_local_experts=2)
    ids, mask = batch(device)
    with torch.no_grad():
        expected = reference.to(device)(ids, attention_mask=mask, labels=ids).loss
        with pytest.warns(LayerByLayerWarning) as caught:
            actual = model.to(device)(ids, attention_mask=mask, labels=ids).loss
    (message,) = [str(each.message) for each in caught if each.category is LayerByLayerWarning]
    assert message.startswith("The 2 layers ran one by one")
    assert "experts_implementation='eager'" in message
    assert "model.set_experts_implementation('batched_mm')" in message
    close(actual, expected, TRAINING)
    # The setting is read at each call: switched, the next call is one scan.
    model.set_experts_implementation("batched_mm")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", LayerByLayerWarning)
        loss = model(ids, attention_mask=mask, labels=ids).loss
        assert torch_xla._XLAC._get_xla_tensors_hlo([loss]).count(" while(") == 1
    close(loss, expected, TRAINING)


def test_switching_the_implementation_after_converting_takes_effect(device):
    reference, model = moe_pair("mixtral", "eager")
    model.set_experts_implementation("batched_mm")
    reference.set_experts_implementation("batched_mm")
    assert_one_scan_with_the_unconverted_step(reference, model, device)


def test_grouped_mm_fails_as_the_unconverted_model_does(device):
    # transformers counts tokens per expert with histc on int32 off the CPU, which
    # torch_xla 2.9.0 runs on the CPU, where histc has no int kernel: the
    # unconverted model cannot train on XLA either.
    reference, model = moe_pair("mixtral", "grouped_mm")
    with pytest.raises(NotImplementedError) as expected:
        training_step(reference, device)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(NotImplementedError) as error:
        warnings.simplefilter("always")
        training_step(model, device)
    assert str(error.value) == str(expected.value)
    assert any("experts_implementation='grouped_mm'" in str(w.message) for w in caught
               if issubclass(w.category, LayerByLayerWarning))


def test_router_logits_and_the_auxiliary_loss_come_from_the_one_scan(device):
    # The loss adds the router's load-balancing loss, computed from every
    # layer's router logits (the scan's per-layer outputs).
    reference, model = moe_pair("mixtral", "batched_mm", output_router_logits=True,
                                router_aux_loss_coef=0.5)
    assert_one_scan_with_the_unconverted_step(reference, model, device)
    ids, mask = batch(device)
    with torch.no_grad():
        expected, actual = (which(ids, attention_mask=mask) for which in (reference, model))
        assert len(actual.router_logits) == len(expected.router_logits) == 2
        for mine, theirs in zip(actual.router_logits, expected.router_logits):
            close(mine, theirs, TRAINING)
        close(actual.aux_loss, expected.aux_loss, TRAINING)
