"""torch_xla_ext.generate against transformers' generate() with a static cache,
on converted and unconverted transformers models."""
import warnings

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import transformers

import torch_xla_ext as tx
from support import supports
from torch_xla_ext.layer_stack import LayerByLayerWarning

VOCAB, PROMPT = 128, 6
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)


def make_model(family="llama", converted=True, device=None):
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config_class(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, use_cache=True, eos_token_id=None))
    if converted:
        model = tx.stack_layers(model)
    return model.to(device or torch_xla.device()).eval()


def prompts(padding=(0, 2)):
    """Prompts padded on the left by `padding` tokens, on the XLA device."""
    ids = torch.randint(1, VOCAB, (len(padding), PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0] * pad + [1] * (PROMPT - pad) for pad in padding])
    return ids.to(torch_xla.device()), mask.to(torch_xla.device())


def compilations() -> int:
    return (met.metric_data("CompileTime") or (0,))[0]


def transformers_tokens(model, ids, mask, new_tokens, **options) -> list:
    xm.set_rng_state(0)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=0,
                              cache_implementation="static", **options).cpu().tolist()


def our_tokens(model, ids, mask, new_tokens, **options) -> list:
    xm.set_rng_state(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayerByLayerWarning)
        return tx.generate(model, ids, new_tokens, attention_mask=mask, pad_token_id=0,
                           **options).cpu().tolist()


CASES = {  # Llama greedy: with three prompts
    "qwen3-greedy": ("qwen3", {}, (0, 2)),
    "llama-sampling": ("llama", SAMPLING, (0, 2)),
    "three-prompts": ("llama", {}, (0, 1, 3)),
}


@supports("tx.generate", (case[0] for case in CASES.values()))
@pytest.mark.parametrize("family, options, padding", CASES.values(), ids=CASES)
def test_the_tokens_of_transformers_generate_with_a_static_cache(family, options, padding):
    model = make_model(family)
    ids, mask = prompts(padding)
    reference = make_model(family, converted=False)
    expected = transformers_tokens(reference, ids, mask, 4, **options)
    assert our_tokens(model, ids, mask, 4, **options) == expected
    # Unconverted, generate() runs the same steps, unrolled.
    assert our_tokens(reference, ids, mask, 4, **options) == expected


def test_a_stack_unrolled_two_layers_an_iteration_prefills_and_decodes_the_unconverted_logits():
    # 3 layers: the loops of the prefill and of the decoding step run 2, then 1 after them.
    ids, mask = prompts()
    logits = []
    for model in (make_model(converted=False), tx.stack_layers(make_model(converted=False),
                                                                unroll=2)):
        with torch.no_grad():
            prefill = model(ids, attention_mask=mask)  # fills a DynamicCache
            step = model(prefill.logits[:, -1:].argmax(-1),
                         attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], 1),
                         past_key_values=prefill.past_key_values)
        logits.append([prefill.logits.cpu(), step.logits.cpu()])
    for converted, unconverted in zip(*logits):
        torch.testing.assert_close(converted, unconverted, rtol=1e-4, atol=1e-4)


def test_64_new_tokens_are_those_of_transformers_generate():
    # transformers' generate() on the XLA device compiles a graph per token, so
    # the unconverted model runs it on the CPU, eagerly (float32 both ways).
    ids, mask = prompts()
    with torch.no_grad():
        expected = make_model(converted=False, device="cpu").generate(
            ids.cpu(), attention_mask=mask.cpu(), max_new_tokens=64, pad_token_id=0,
            do_sample=False, cache_implementation="static").tolist()
    assert all(len(set(row[PROMPT:])) > 10 for row in expected)  # not one token repeated
    assert our_tokens(make_model(), ids, mask, 64) == expected


def test_one_decoding_graph_serves_any_number_of_new_tokens():
    # Converted on the device, as a script that moves the model first does.
    model = tx.stack_layers(make_model(converted=False))
    ids, mask = prompts()
    # Pending when the first call starts, as a prompt computed on the device is.
    ids, mask = ids + 0, mask + 0
    short = our_tokens(model, ids, mask, 2, max_cache_len=PROMPT + 12)
    before, traces = compilations(), tx.cache_info().misses
    long = our_tokens(model, ids, mask, 12, max_cache_len=PROMPT + 12)
    again = our_tokens(model, ids, mask, 2, max_cache_len=PROMPT + 12)
    # The second and third calls compile and trace nothing.
    assert compilations() == before and tx.cache_info().misses == traces
    assert again == short
    assert [row[:PROMPT + 2] for row in long] == short
    # The first call compiled the prefill, one decoding step and a few small
    # graphs around them (transformers' mask check, the joining of the tokens).
    model = make_model(converted=False)
    before = compilations()
    our_tokens(model, ids, mask, 6, max_cache_len=PROMPT + 12)
    first = compilations() - before
    our_tokens(model, ids, mask, 12, max_cache_len=PROMPT + 12)
    assert first <= 5 and compilations() - before == first


def test_a_row_gets_padding_after_its_end_token_and_generation_stops_when_all_end():
    model = make_model()
    ids, mask = prompts()
    free = our_tokens(model, ids, mask, 6)
    end = free[0][PROMPT + 1]  # the first row's second new token
    ended = tx.generate(model, ids, 6, attention_mask=mask, eos_token_id=end,
                        pad_token_id=0).cpu().tolist()
    for row, free_row in zip(ended, free):
        new = row[PROMPT:]
        if end in free_row[PROMPT:]:
            stop = free_row.index(end, PROMPT) - PROMPT
            assert new[:stop + 1] == free_row[PROMPT:PROMPT + stop + 1]
            assert set(new[stop + 1:]) <= {0}
        else:
            assert new == free_row[PROMPT:len(row)]
    if all(end in free_row[PROMPT:] for free_row in free):
        assert len(ended[0]) < len(free[0])  # every row ended: no more steps
    # Ending every row at its first token stops after one.
    firsts = [row[PROMPT] for row in free]
    stopped = tx.generate(model, ids, 6, attention_mask=mask, eos_token_id=firsts, pad_token_id=0)
    assert stopped.cpu().tolist() == [row[:PROMPT + 1] for row in free]


@pytest.mark.parametrize("call, message", [
    (lambda m, ids: tx.generate(m, ids.cpu(), 2), "is on cpu; move it to the XLA device"),
    (lambda m, ids: tx.generate(m, ids, 0), "max_new_tokens must be a positive int, got 0"),
    (lambda m, ids: tx.generate(m, ids[0], 2), r"must be \[batch, prompt\] integer token ids"),
    (lambda m, ids: tx.generate(m, ids, 8, max_cache_len=10),
     "need 14 cache positions, more than max_cache_len=10"),
    (lambda m, ids: tx.generate(m, ids, 2, attention_mask=ids[:, 1:]),
     r"attention_mask must be a tensor shaped as input_ids \(2, 6\), got \(2, 5\)"),
    (lambda m, ids: tx.generate(m, ids, 2, do_sample=True, temperature=0.0),
     "temperature must be > 0 to sample, got 0.0"),
    (lambda m, ids: tx.generate(m, ids, 2, eos_token_id="</s>"),
     "eos_token_id must be an int or a list of ints, got '</s>'"),
])
def test_bad_arguments_are_refused_naming_the_value(call, message):
    model = make_model()
    ids, _ = prompts()
    with pytest.raises((ValueError, TypeError), match=message):
        call(model, ids)
