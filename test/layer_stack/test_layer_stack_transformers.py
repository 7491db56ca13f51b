"""LayerStack and scan_layers on transformers' own decoder layers (Llama, Mistral,
Qwen2; small configs, random weights), against the ModuleList loop the models'
forward runs. The layers are passed as they are: no ignored or per-layer
attributes named, though each attention layer holds its own `layer_idx`."""
import copy
import warnings

import pytest
import torch
import torch_xla
from torch import nn
from transformers import (DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)
from transformers.masking_utils import create_causal_mask

from torch_xla_ext.layer_stack import LayerByLayerWarning, LayerStack, scan_layers
from tolerances import TRAINING, close

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"sliding_window": None,
                                              "use_sliding_window": False}),
}
VOCAB, BATCH, SEQ = 64, 2, 5


def make_model(family: str, device) -> nn.Module:
    config_type, model_type, extra = FAMILIES[family]
    config = config_type(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, use_cache=False,
                         attn_implementation="eager", **extra)
    torch.manual_seed(0)
    return model_type(config).to(device)


def layer_inputs(model: nn.Module, ids: torch.Tensor, cache=None, past: int = 0):
    """The hidden states and keyword arguments the model's forward gives its layers."""
    decoder = model.model
    hidden = decoder.embed_tokens(ids)
    position_ids = torch.arange(past, past + ids.shape[1], device=ids.device).unsqueeze(0)
    mask = create_causal_mask(config=decoder.config, inputs_embeds=hidden, attention_mask=None,
                              past_key_values=cache, position_ids=position_ids)
    return hidden, {"attention_mask": mask, "position_ids": position_ids,
                    "position_embeddings": decoder.rotary_emb(hidden, position_ids=position_ids)}


def loop(layers, hidden, **kwargs):
    for layer in layers:
        output = layer(hidden, **kwargs)
        hidden = output[0] if isinstance(output, tuple) else output
    return hidden


class Carried(nn.Module):
    """How torch_xla's scan_layers runs such layers: the extra arguments travel
    in the tuple each layer takes and returns."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, hidden, attention_mask, position_ids, cos, sin):
        output = self.layer(hidden, attention_mask=attention_mask, position_ids=position_ids,
                            position_embeddings=(cos, sin))
        hidden = output[0] if isinstance(output, tuple) else output
        return hidden, attention_mask, position_ids, cos, sin


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_layers_match_the_module_list_loop(device, family, training):
    model = make_model(family, device).train(training)
    layers = model.model.layers
    stack = LayerStack(copy.deepcopy(layers))
    carried = [Carried(layer) for layer in copy.deepcopy(layers)]
    assert [layer.self_attn.layer_idx for layer in stack] == [0, 1, 2, 3]
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
    hidden, kwargs = layer_inputs(model, ids)
    cos, sin = kwargs["position_embeddings"]
    inputs = [hidden.detach().clone().requires_grad_(training) for _ in range(3)]
    probe = torch.randn(hidden.shape, device=device)

    with torch.set_grad_enabled(training), warnings.catch_warnings():
        warnings.simplefilter("error", LayerByLayerWarning)  # each runs as one scan
        # use_cache=True without a cache object caches nothing: still one scan.
        expected = loop(layers, inputs[0], use_cache=not training, **kwargs)
        actual = stack(inputs[1], use_cache=not training, **kwargs)
        drop_in = scan_layers(carried, (inputs[2], kwargs["attention_mask"],
                                        kwargs["position_ids"], cos, sin))[0]
    assert "while" in torch_xla._XLAC._get_xla_tensors_hlo([actual, drop_in])
    if training:
        for output in (expected, actual, drop_in):
            (output * probe).sum().backward()
    torch_xla.sync()
    close(actual, expected, TRAINING)
    close(drop_in, expected, TRAINING)
    if training:
        for index, layer in enumerate(layers):
            expected_grad = layer.self_attn.q_proj.weight.grad
            close(stack.stacked.self_attn.q_proj.weight.grad[index], expected_grad, TRAINING)
            close(carried[index].layer.self_attn.q_proj.weight.grad, expected_grad, TRAINING)
        close(inputs[1].grad, inputs[0].grad, TRAINING)
        close(inputs[2].grad, inputs[0].grad, TRAINING)


@pytest.mark.parametrize("family", FAMILIES)
def test_key_value_cache_gives_the_loops_result(device, family):
    """Prefill then two decoding steps, each layer writing its own cache slot."""
    model = make_model(family, device).eval()
    layers = model.model.layers
    stack = LayerStack(copy.deepcopy(layers))
    caches = [DynamicCache(config=model.config) for _ in range(2)]
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 2), device=device)
    past = 0
    with torch.no_grad():
        for step_ids in (ids[:, :SEQ], ids[:, SEQ:SEQ + 1], ids[:, SEQ + 1:]):
            hidden, kwargs = layer_inputs(model, step_ids, caches[0], past)
            expected = loop(layers, hidden, past_key_values=caches[0], use_cache=True, **kwargs)
            with pytest.warns(LayerByLayerWarning,
                              match=r"kwargs\['past_key_values'\] is of type DynamicCache"):
                actual = stack(hidden, past_key_values=caches[1], use_cache=True, **kwargs)
            torch_xla.sync()
            close(actual, expected, TRAINING)
            past += step_ids.shape[1]
    assert caches[1].get_seq_length() == SEQ + 2
    for expected_layer, actual_layer in zip(caches[0].layers, caches[1].layers, strict=True):
        close(actual_layer.keys, expected_layer.keys, TRAINING)
        close(actual_layer.values, expected_layer.values, TRAINING)
