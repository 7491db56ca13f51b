"""Hybrid models whose config repeats a pattern of layer kinds that differ
in structure: Nemotron-H's Mamba ("M"), MLP ("-"), attention ("*") and
mixture-of-experts ("E") layers, against the same model unconverted.

A stack stores such a list as the fewest segments (`segments.plan_segments`):
a pattern repeated whole as groups, one scan running a group per step; where
the pattern changes, groups of another pattern, and layers as themselves."""
import copy
import warnings

import pytest
import torch
import torch_xla
import transformers
from torch.utils._pytree import tree_flatten

from support import greedy_tokens_of_both, supports
from test_hf import VOCAB
from test_hf_layer_kinds import assert_same_step, training_step_of_both
from tolerances import THROUGH_LAYERS, TRAINING, close, close_by_name
from torch_xla_ext.hf import stack_layers
from torch_xla_ext.diagnostics import Refusal
from torch_xla_ext.hf.cache_plan import DYNAMIC_GRADIENTS_REASON, plan_cache_call
from torch_xla_ext.layer_stack import LayerByLayerWarning
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
    # The prefill fills the empty cache from the scan; each decoding step's
    # scan reads the Mamba layers' convolution and recurrent states and the
    # attention layers' keys and values, stacked, and gives them back.
    reference, model = nemotron_h_pair(NANO_OPENING)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    tokens, one_by_one = greedy_tokens_of_both(reference, model, prompt.to(device), 2)
    assert tokens[1] == tokens[0]
    assert one_by_one == []


def _cache_tensors(cache) -> list:
    """Each cache layer's tensors (states, keys, values), in order."""
    return [leaf for layer in cache.layers for leaf in tree_flatten(vars(layer))[0]
            if isinstance(leaf, torch.Tensor)]


@supports("generate", "nemotron_h")
@pytest.mark.parametrize("pattern", ["MMM*", "M*M*M*"])
def test_decoding_steps_with_held_states_run_as_one_scan(device, pattern):
    # A run of Mamba layers, and groups of (Mamba, attention): each step's
    # cache holds states alike at each position, which one scan reads and
    # gives back; two steps, so the second reads what the first wrote.
    reference, model = nemotron_h_pair(pattern)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    results = []
    for which in (reference, model):
        which.to(device).eval()
        with torch.no_grad():
            output = which(prompt.to(device), use_cache=True)
            torch_xla.sync()  # the prefill's graph apart from the steps'
            cache, loops, logits = output.past_key_values, [], []
            for _ in range(2):
                token = output.logits[:, -1:].argmax(-1)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    output = which(token, past_key_values=cache, use_cache=True)
                loops.append(torch_xla._XLAC._get_xla_tensors_hlo([output.logits])
                             .count(" while("))
                assert [each for each in caught if each.category is LayerByLayerWarning] == []
                logits.append(output.logits)
                torch_xla.sync()
        results.append((loops, logits, _cache_tensors(cache)))
    (_, logits, held), (loops, converted_logits, converted_held) = results
    assert loops == [1, 1]
    for converted, unconverted in zip(converted_logits, logits):
        close(converted, unconverted, THROUGH_LAYERS)
    assert len(converted_held) == len(held)
    for converted, unconverted in zip(converted_held, held):
        close(converted, unconverted, THROUGH_LAYERS)


def test_a_cache_holding_alike_states_is_planned_as_a_scan_without_gradients(device):
    # The plan of the groups' scan over a decoding step's cache: its held
    # states stacked by position; with gradients, which the states given
    # back would lose, the layers run one by one, saying why.
    reference, _ = nemotron_h_pair("M*M*M*")
    with torch.no_grad():
        cache = reference.to(device).eval()(torch.ones(2, 5, dtype=torch.long, device=device),
                                            use_cache=True).past_key_values
    plan = plan_cache_call(cache, "past_key_values", 6, 1, device, gradients=False, period=2)
    assert plan.period == 2 and plan.fresh is not None
    mamba, attention = cache.layers[0], cache.layers[1]
    per_position = [[leaf for leaf in tree_flatten(vars(layer))[0] if isinstance(leaf, torch.Tensor)]
                    for layer in (mamba, attention)]
    assert [tuple(each.shape) for each in plan.held] == [
        (3, *tensor.shape) for tensors in per_position for tensor in tensors]
    assert plan_cache_call(cache, "past_key_values", 6, 1, device, gradients=True,
                           period=2) == Refusal(DYNAMIC_GRADIENTS_REASON)


def zamba_pair():
    """A small Zamba (Mamba layers, and at layers 2 and 4 hybrid layers that
    share one attention block), and a converted copy with the same weights."""
    config = transformers.ZambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
        mamba_d_state=4, mamba_dt_rank=4, n_mamba_heads=1, use_cache=False)
    torch.manual_seed(0)
    reference = transformers.ZambaForCausalLM(config)
    return reference, stack_layers(copy.deepcopy(reference))


def test_a_block_the_hybrid_layers_share_stays_one_parameter_and_trains_in_the_scan(device):
    reference, model = zamba_pair()
    layers = model.model.layers
    assert layers.plan == (Segment(0, 1, 2), Segment(2, 2, 2))  # then groups of (hybrid, Mamba)
    step = training_step_of_both(reference, model, device)
    assert not step["one_by_one"] and step["while_loops"] == 4  # two scans, each way
    # The block stays one set of Parameters, through .to(device) too, with the sum
    # of both layers' gradients. (On XLA, .to(device) unties the unconverted
    # model's: its layers 2 and 4 then hold copies, each with its layer's gradient.)
    shared = dict(layers[2].shared_transf.named_parameters())
    assert all(param is dict(layers[4].shared_transf.named_parameters())[name]
               for name, param in shared.items())
    (reference_loss, reference_grads), (loss, grads) = step["reference"], step["model"]
    close(loss, reference_loss, TRAINING)
    for name in shared:
        first, second = (f"model.layers.{index}.shared_transf.{name}" for index in (2, 4))
        reference_grads[first] = reference_grads[first] + reference_grads.pop(second)
    close_by_name(grads, reference_grads, TRAINING)
