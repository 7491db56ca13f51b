"""Hybrid models whose config repeats a pattern of layer kinds that differ
in structure: Nemotron-H's Mamba ("M"), MLP ("-"), attention ("*") and
mixture-of-experts ("E") layers, against the same model unconverted.

A stack stores such a list as the fewest segments (`segments.plan_segments`):
a pattern repeated whole as groups, one scan running a group per step; where
the pattern changes, groups of another pattern, and layers as themselves."""
import copy

import torch
import transformers

from support import greedy_tokens_of_both, supports
from test_hf import VOCAB, device  # noqa: F401 (a fixture)
from test_hf_layer_kinds import assert_same_step, training_step_of_both
from torch_xla_ext.hf import stack_layers
from torch_xla_ext.layer_stack.segments import Segment

# The patterns (hybrid_override_pattern) of two checkpoints' configs, 52 layers each.
NEMOTRON_H_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_3_NANO_30B = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
# The first 7 layers of the Nano's: a Mamba layer, two groups of (experts,
# Mamba), the attention layer, experts.
NANO_OPENING = NEMOTRON_3_NANO_30B[:7]


def nemotron_h_pair(pattern: str):
    """A small Nemotron-H of `pattern` with `batched_mm` experts, and a
    converted copy with the same weights."""
    config = transformers.NemotronHConfig(
        hybrid_override_pattern=pattern, vocab_size=VOCAB, hidden_size=32,
        intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8, chunk_size=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16, attn_implementation="eager")
    torch.manual_seed(0)
    reference = transformers.NemotronHForCausalLM(config)
    reference.set_experts_implementation("batched_mm")
    return reference, stack_layers(copy.deepcopy(reference))


def test_the_checkpoints_patterns_are_stored_as_groups_of_their_repeats():
    # 8B: "M-M-M-M*-M-" four times, then (Mamba, MLP) four times.
    _, model = nemotron_h_pair(NEMOTRON_H_8B)
    assert model.model.layers.plan == (Segment(0, 11, 4), Segment(44, 2, 4))
    # Nano: "MEMEM*E" four times, "MEMEMEM*E" twice, then (Mamba, experts) three times.
    _, model = nemotron_h_pair(NEMOTRON_3_NANO_30B)
    assert model.model.layers.plan == (Segment(0, 7, 4), Segment(28, 9, 2), Segment(46, 2, 3))


@supports("training", "nemotron_h")
@supports("default cache", "nemotron_h")
def test_a_pattern_trains_as_a_scan_over_its_groups_and_layers_as_themselves(device):
    # The config's use_cache=True: the step fills a DynamicCache of Mamba
    # states and attention keys and values, from the scan and the layers.
    reference, model = nemotron_h_pair(NANO_OPENING)
    assert model.model.layers.plan == (Segment(0, 1, 1), Segment(1, 2, 2), Segment(5, 1, 1),
                                       Segment(6, 1, 1))
    step = training_step_of_both(reference, model, device)
    assert_same_step(step)
    assert step["one_by_one"] == []
    assert step["while_loops"] == 2  # the groups' scan: a forward and a backward loop


@supports("generate", "nemotron_h")
def test_generate_gives_the_unconverted_tokens(device):
    # The prefill fills the empty cache from the scan. A decoding step's
    # cache holds the Mamba layers' convolution and recurrent states, which
    # no scan reads: that step runs one by one, saying so.
    reference, model = nemotron_h_pair(NANO_OPENING)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    tokens, one_by_one = greedy_tokens_of_both(reference, model, prompt.to(device), 2)
    assert tokens[1] == tokens[0]
    assert len(one_by_one) == 1 and "key/value cache passed (past_key_values)" in one_by_one[0]
