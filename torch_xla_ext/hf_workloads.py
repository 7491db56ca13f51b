"""transformers training workloads shared by the benchmarks (scripts/bench_hf.py)
and the metric comparison (scripts/compare_metrics.py --hf): small built-in
configs of several model families, their training inputs, and the wrapper
that runs a model's decoder layers with torch_xla's `scan_layers`.

Importing this module imports neither torch nor transformers (a script's parent
process checks a family name without them); each function imports what it needs.
"""
from __future__ import annotations

import dataclasses
import math

FAMILIES = ("llama", "qwen3", "gemma2", "gemma3", "qwen2-window", "gpt2", "mixtral",
            "qwen3_moe", "bert", "vit", "t5")
# The transformers auto class of each family that is not a causal LM.
AUTO_CLASSES = {"bert": "AutoModelForMaskedLM", "vit": "AutoModelForImageClassification",
                "t5": "AutoModelForSeq2SeqLM"}
# The families whose models make no key/value cache.
WITHOUT_CACHE = ("bert", "vit")
DEFAULT_AUTO_CLASS = "AutoModelForCausalLM"
# Mixture-of-experts models: their experts, and the experts implementation
# whose shapes do not depend on the routing, so that the layers scan.
MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")
EXPERTS, EXPERTS_PER_TOKEN = 4, 2
EXPERTS_IMPLEMENTATION = "batched_mm"
VIT_PATCH = 16
# The model types whose decoder layer takes the call the scan_layers wrapper
# makes (hidden states, rotary embeddings, mask), under `model.model.layers`.
TORCH_XLA_SCAN_MODEL_TYPES = ("llama",)


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """The sizes of a built-in config. GPT-2, BERT and ViT have as many
    key/value heads as heads; `vocab` is ViT's number of classes."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    seq: int


def family_config(family: str, sizes: ModelSizes, use_cache: bool = False):
    """The config of `family` (one of FAMILIES) at `sizes`, dropout off.
    gemma3 (text) has its default pattern of 5 sliding-window layers and 1
    full; qwen2-window full attention in its first half and a window of half
    the sequence in the rest; mixtral and qwen3_moe EXPERTS experts of
    `intermediate`, EXPERTS_PER_TOKEN per token; t5 an encoder and a decoder
    of `layers` blocks each."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"Unknown model family {family!r}; choose from {', '.join(FAMILIES)}.")
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=sizes.vocab, n_embd=sizes.hidden, n_layer=sizes.layers,
            n_head=sizes.heads, n_inner=sizes.intermediate, n_positions=sizes.seq,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=use_cache)
    if family == "bert":
        return transformers.BertConfig(
            vocab_size=sizes.vocab, hidden_size=sizes.hidden, num_hidden_layers=sizes.layers,
            num_attention_heads=sizes.heads, intermediate_size=sizes.intermediate,
            max_position_embeddings=sizes.seq, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
    if family == "t5":  # an encoder and a decoder of `layers` blocks each
        return transformers.T5Config(
            vocab_size=sizes.vocab, d_model=sizes.hidden, d_ff=sizes.intermediate,
            num_layers=sizes.layers, num_decoder_layers=sizes.layers, num_heads=sizes.heads,
            d_kv=sizes.hidden // sizes.heads, dropout_rate=0.0, decoder_start_token_id=0,
            use_cache=use_cache)
    if family == "vit":
        return transformers.ViTConfig(
            hidden_size=sizes.hidden, num_hidden_layers=sizes.layers,
            num_attention_heads=sizes.heads, intermediate_size=sizes.intermediate,
            image_size=vit_image_size(sizes.seq), patch_size=VIT_PATCH, num_labels=sizes.vocab,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config_class, settings = {
        "llama": (transformers.LlamaConfig, {}),
        "qwen3": (transformers.Qwen3Config, {}),
        "gemma2": (transformers.Gemma2Config, {}),
        "gemma3": (transformers.Gemma3TextConfig, {}),
        "qwen2-window": (transformers.Qwen2Config, dict(
            use_sliding_window=True, max_window_layers=sizes.layers // 2,
            sliding_window=sizes.seq // 2)),
        "mixtral": (transformers.MixtralConfig, dict(
            num_local_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN)),
        "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
            moe_intermediate_size=sizes.intermediate, num_experts=EXPERTS,
            num_experts_per_tok=EXPERTS_PER_TOKEN)),
    }[family]
    return config_class(
        vocab_size=sizes.vocab, hidden_size=sizes.hidden, intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers, num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads, head_dim=sizes.hidden // sizes.heads,
        use_cache=use_cache, **settings)


def vit_image_size(seq: int) -> int:
    """The side in pixels of square images of floor(sqrt(seq))^2 patches."""
    return math.isqrt(seq) * VIT_PATCH


def model_from_config(config, family: str | None = None):
    """A model with random weights (seeded, so the same in every mode) of
    `family`'s auto class (a causal LM without one), MoE layers with
    EXPERTS_IMPLEMENTATION."""
    import torch
    import transformers

    torch.manual_seed(0)
    auto_class = getattr(transformers, AUTO_CLASSES.get(family, DEFAULT_AUTO_CLASS))
    experts = ({"experts_implementation": EXPERTS_IMPLEMENTATION}
               if config.model_type in MOE_MODEL_TYPES else {})
    return auto_class.from_config(config, **experts)


def training_inputs(family: str | None, vocab: int, batch: int, seq: int, device) -> dict:
    """The keyword arguments of a training step of `family` (a causal LM
    without one), labels included: tokens for language models (BERT's a
    padded batch, the sequences from the full length down to half of it, the
    labels -100 at padding), random images of floor(sqrt(seq))^2 patches and
    `vocab` classes for ViT."""
    import torch

    generator = torch.Generator().manual_seed(1)
    if family == "vit":
        side = vit_image_size(seq)
        return {"pixel_values": torch.randn(batch, 3, side, side, generator=generator).to(device),
                "labels": torch.randint(0, vocab, (batch,), generator=generator).to(device)}
    tokens = torch.randint(0, vocab, (batch, seq), generator=generator)
    if family != "bert":
        return {"input_ids": tokens.to(device), "labels": tokens.to(device)}
    lengths = torch.linspace(seq, seq // 2, batch).round().long()
    attention_mask = (torch.arange(seq) < lengths[:, None]).long()
    return {"input_ids": tokens.to(device), "attention_mask": attention_mask.to(device),
            "labels": tokens.masked_fill(attention_mask == 0, -100).to(device)}


def torch_xla_scan_unsupported(model_type: str) -> str | None:
    """Why torch_xla_scan_layers_wrapper cannot run models of `model_type`, or None."""
    if model_type in TORCH_XLA_SCAN_MODEL_TYPES:
        return None
    return (f"the torch_xla scan_layers wrapper knows the layer call of "
            f"{', '.join(TORCH_XLA_SCAN_MODEL_TYPES)} models only, not {model_type}")


def torch_xla_scan_layers_wrapper(layers):
    """A module in place of the decoder-layer list that runs the layers with
    torch_xla's scan_layers, which passes a layer nothing but its carry: each
    layer is wrapped to take the extra arguments from the carry and return
    them with the new hidden state, as users do today."""
    from torch import nn
    from torch_xla.experimental.scan_layers import scan_layers

    class BroadcastArguments(nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, hidden_states, cos, sin, *attention_mask):
            hidden_states = self.layer(hidden_states, position_embeddings=(cos, sin),
                                       attention_mask=attention_mask[0] if attention_mask else None)
            return (hidden_states, cos, sin, *attention_mask)

    class ScannedLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(BroadcastArguments(layer) for layer in layers)

        def __getitem__(self, index):
            # The model's `for decoder_layer in self.layers[: n]` gets this one callable.
            return [self]

        def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **_):
            carry = (hidden_states, *position_embeddings,
                     *(() if attention_mask is None else (attention_mask,)))
            # Pure layers let torch_xla cache its trace across steps, its fastest setting.
            return scan_layers(self.layers, carry, is_layer_pure=True)[0]

    return ScannedLayers()
