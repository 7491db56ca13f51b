"""Layers that keep state on their own modules (layer_stack.layer_state), in
transformers' models: RecurrentGemma's recurrent blocks keep their
convolution and recurrence states, which the next decoding step reads;
Reformer's layers keep the dropout seeds that their reversible backward
reads. Converted, such layers run one by one on modules that keep them:
training and generate() give the unconverted model's results."""
import copy
import warnings

import torch
import transformers

from test_hf import VOCAB
from test_hf_layer_kinds import assert_same_step, training_step_of_both
from tolerances import THROUGH_LAYERS, close
from torch_xla_ext.hf import stack_layers
from torch_xla_ext.layer_stack import LayerByLayerWarning


def recurrent_gemma_pair():
    """A small RecurrentGemma (recurrent, recurrent, attention blocks) and a
    converted copy with the same weights."""
    config = transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, attention_window_size=4,
        attn_implementation="eager")
    torch.manual_seed(0)
    reference = transformers.RecurrentGemmaForCausalLM(config)
    return reference, stack_layers(copy.deepcopy(reference))


STATE_WARNING = ("layer 0 sets its attributes ['temporal_block.conv1d_state', "
                 "'temporal_block.rg_lru.recurrent_states'] while it runs")


def test_recurrent_blocks_keeping_their_state_train_as_unconverted(device):
    reference, model = recurrent_gemma_pair()
    step = training_step_of_both(reference, model, device)  # with its default cache
    assert_same_step(step)
    assert len(step["one_by_one"]) == 1 and STATE_WARNING in step["one_by_one"][0]


def test_recurrent_blocks_decode_the_unconverted_tokens_from_the_state_they_keep(device):
    reference, model = recurrent_gemma_pair()
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    prompt = prompt.to(device)
    tokens, logits = [], []
    for which in (reference, model):
        which.to(device).eval()
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            output = which.generate(prompt, max_new_tokens=4, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
        tokens.append(output.sequences.cpu())
        logits.append(torch.stack(output.logits).cpu())
    assert tokens[1].tolist() == tokens[0].tolist()
    # The decoding steps' logits too: a tiny model's greedy tokens could agree without the state.
    close(logits[1], logits[0], THROUGH_LAYERS)
    warned = {str(each.message) for each in caught if each.category is LayerByLayerWarning}
    assert warned and all(STATE_WARNING in each for each in warned)


def test_reversible_layers_keeping_their_dropout_seeds_train_as_unconverted(device):
    # Their backward (outside the forward) reads the seeds each layer set in it.
    config = transformers.ReformerConfig(
        vocab_size=VOCAB, hidden_size=32, attention_head_size=8, num_attention_heads=4,
        feed_forward_size=64, attn_layers=["local", "local", "local"], is_decoder=True,
        axial_pos_shape=[2, 4], axial_pos_embds_dim=[8, 24], local_attn_chunk_length=4,
        hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, use_cache=False)
    torch.manual_seed(0)
    reference = transformers.ReformerModelWithLMHead(config)
    model = stack_layers(copy.deepcopy(reference))
    for _ in range(2):  # the second step's layers are the kept ones
        step = training_step_of_both(reference, model, device)
        assert_same_step(step)
        assert step["one_by_one"] == [
            "The 3 layers ran one by one, as the for loop does, instead of as one scan: layer 0 "
            "sets its attributes ['attention_seed', 'feed_forward_seed'] while it runs, which a "
            "scan's steps cannot keep per layer: such layers run one by one, each keeping its "
            "own, as unconverted."]
