"""Layers stored as runs of different structures: DeepSeek-V3's first dense
layers, then its mixture-of-experts layers, as two scans, trained and
decoded (generate() with a DynamicCache, tx.generate with a StaticCache)
with the unconverted model's results and no layer run one by one."""
import copy
import warnings

import pytest
import torch
import transformers

from support import supports
from test_hf import VOCAB, device  # noqa: F401 (a fixture)
from test_hf_layer_kinds import assert_same_step, training_step_of_both
import torch_xla_ext as tx
from torch_xla_ext.hf import stack_layers
from torch_xla_ext.layer_stack import LayerByLayerWarning
from torch_xla_ext.layer_stack.segments import Segment

DENSE, LAYERS = 2, 5


def deepseek_pair():
    """A small DeepSeek-V3 (2 dense layers, then 3 of experts) with
    `batched_mm` experts, and a converted copy with the same weights."""
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=LAYERS, first_k_dense_replace=DENSE, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, head_dim=8, max_position_embeddings=64,
        attn_implementation="eager")
    torch.manual_seed(0)
    reference = transformers.DeepseekV3ForCausalLM(config)
    reference.set_experts_implementation("batched_mm")
    return reference, stack_layers(copy.deepcopy(reference))


@supports("training", "deepseek_v3")
@supports("default cache", "deepseek_v3")
def test_dense_then_experts_train_as_two_scans(device):
    reference, model = deepseek_pair()
    assert model.model.layers.plan == (Segment(0, 1, DENSE), Segment(DENSE, 1, LAYERS - DENSE))
    step = training_step_of_both(reference, model, device)
    assert_same_step(step)
    assert step["one_by_one"] == []
    assert step["while_loops"] == 4  # a forward and a backward loop per run


@supports("generate", "deepseek_v3")
@supports("tx.generate", "deepseek_v3")
@pytest.mark.parametrize("generate", ["generate", "tx.generate"])
def test_dense_then_experts_decode_the_unconverted_tokens_as_scans(device, generate):
    # generate() with its DynamicCache; tx.generate with a StaticCache.
    reference, model = deepseek_pair()
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    prompt = prompt.to(device)
    tokens = []
    for which in (reference, model):
        which.to(device).eval()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", LayerByLayerWarning)
            tokens.append((which.generate(prompt, max_new_tokens=3, do_sample=False)
                           if generate == "generate" else
                           tx.generate(which, prompt, max_new_tokens=3, max_cache_len=16)).cpu())
    assert tokens[1].tolist() == tokens[0].tolist()
