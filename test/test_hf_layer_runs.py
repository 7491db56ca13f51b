"""Layers stored as runs of different structures: DeepSeek-V3's first dense
layers, then its mixture-of-experts layers, as two scans, trained and
decoded (generate() with a DynamicCache, tx.generate with a StaticCache)
with the unconverted model's results and no layer run one by one; Gemma 4's
layers that reuse the key/value states earlier layers store in a mapping
every layer gets, scanned around the layers that store them, and its groups
of sliding and full layers, each layer given its own per-layer input, as one
scan."""
import copy
import warnings

import pytest
import torch
import transformers

from support import greedy_tokens_of_both, supports
from test_hf import VOCAB
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


def gemma4_sharing_pair():
    """A small Gemma 4 text model whose last 2 of 6 layers (full attention)
    reuse the key/value states that layer 3 stores (layer 2 stores the
    sliding attention layers', which none reuses), and a converted copy with
    the same weights."""
    config = transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8,
        layer_types=["sliding_attention", "full_attention"] * 2 + ["full_attention"] * 2,
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        sliding_window=4, attn_implementation="eager")
    assert config.kv_sharing_modes == [None, None, "store", "store", "reuse", "reuse"]
    torch.manual_seed(0)
    reference = transformers.Gemma4ForCausalLM(config)
    return reference, stack_layers(copy.deepcopy(reference))


def test_layers_reusing_stored_key_values_train_as_scans_around_the_storing_layers(device):
    reference, model = gemma4_sharing_pair()
    step = training_step_of_both(reference, model, device)
    assert_same_step(step)
    assert step["one_by_one"] == []
    # Layers 0-1 and the reusing layers 4-5: a forward and a backward loop each.
    assert step["while_loops"] == 4


def test_layers_reusing_stored_key_values_decode_the_unconverted_tokens(device):
    reference, model = gemma4_sharing_pair()
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    tokens, one_by_one = greedy_tokens_of_both(reference, model, prompt.to(device), 2)
    assert tokens[1] == tokens[0]
    # With a cache, the sliding and full attention layers 0-1 compute
    # differently and run one by one; the reusing layers 4-5 scan.
    one_by_one = set(one_by_one)
    assert len(one_by_one) == 1 and "layers 0-1 compute differently" in one_by_one.pop()


def test_groups_whose_layers_each_get_their_own_input_train_as_one_scan(device):
    # Without a cache, Gemma 4's full attention layers (wider heads than its
    # sliding ones) run with its sliding ones as one scan over groups of the
    # pattern, stored as groups, in which each
    # position picks its group's slice of the per-layer inputs (each layer's
    # own argument).
    config = transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, sliding_window=4,
        use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    reference = transformers.Gemma4ForCausalLM(config)
    model = stack_layers(copy.deepcopy(reference))
    step = training_step_of_both(reference, model, device)
    assert_same_step(step)
    assert model.model.layers.plan == (Segment(0, 3, 2),)
    assert step["one_by_one"] == []
    assert step["while_loops"] == 2


def test_layers_that_index_the_cache_by_their_index_and_an_offset_run_one_by_one_saying_why(
        device):
    # HRM runs each of its two stacks several cycles, each layer updating the
    # cache at `layer_idx + cycle_offset`: one trace cannot stand for every
    # layer (the sum is the read index's), and the trace that went on with
    # layer 0's index and failed is not the reason given: the read is.
    config = transformers.HrmTextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=16,  # 2 x (2 x 3 + 2)
        num_layers_per_stack=2, num_attention_heads=2, head_dim=16, H_cycles=2, L_cycles=3,
        max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config)
    model = stack_layers(copy.deepcopy(reference))
    step = training_step_of_both(reference, model, device)
    assert_same_step(step)
    # (Later cycles find the cache holding the first's tokens: a reason of its own.)
    assert "the layer reads ['self_attn.layer_idx']" in step["one_by_one"][0], step["one_by_one"]
