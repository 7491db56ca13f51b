"""output_hidden_states and output_attentions of a model converted by
stack_layers, against the same model unconverted: the tuples come from the
one scan (its per-step outputs, replayed to transformers' output-capturing
hooks), in a forward, in training and in generate()."""
import copy
import re
import warnings

import pytest
import torch
import torch_xla
import transformers

import test_hf_layer_kinds as layer_kinds
from test_hf import VOCAB, batch, left_padded_prompts, per_layer_grads
from tolerances import TRAINING, close, close_by_name
import torch_xla_ext as tx
from torch_xla_ext.hf import StackedLayers, stack_layers
from torch_xla_ext.layer_stack import LayerByLayerWarning

LAYERS = 3


def converted_pair(family="llama", **config):
    """A tiny model with eager attention (whose attention weights transformers
    returns) and a converted copy with the same weights."""
    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                    use_cache=False, attn_implementation="eager")
    if family == "gemma2":  # alternating sliding and full attention: one StackedLayers
        settings.update(head_dim=8, sliding_window=4)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM)}[family]
    torch.manual_seed(0)
    reference = model_class(config_class(**{**settings, **config}))
    model = stack_layers(copy.deepcopy(reference))
    assert type(model.model.layers) is StackedLayers
    return reference, model


def assert_same_tuples(actual: tuple, expected: tuple, length: int):
    assert len(actual) == len(expected) == length
    for got, want in zip(actual, expected):
        assert got.shape == want.shape
        close(got, want, TRAINING)


def one_scan(run):
    """`run()`'s result, asserting that it traced the layers once and ran no
    layer on its own."""
    traces_before = tx.cache_info().misses
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayerByLayerWarning)
        result = run()
    assert tx.cache_info().misses - traces_before == 1
    return result


@pytest.mark.parametrize("family, use_cache, in_config, attention", [
    ("llama", False, False, "eager"), ("llama", True, False, "eager"),
    ("llama", False, True, "eager"), ("gemma2", True, False, "eager"),
    ("llama", False, False, "sdpa")],
    ids=["llama", "llama-empty-dynamic-cache", "llama-config-flags", "gemma2-kinds",
         "llama-sdpa"])
def test_hidden_states_and_attentions_are_the_unconverted_models(device, family, use_cache,
                                                                 in_config, attention):
    # SDPA returns no attention weights: transformers' tuple of them is empty.
    reference, model = converted_pair(family, use_cache=use_cache,
                                      attn_implementation=attention)
    ids, mask = batch(device)
    flags = dict(output_hidden_states=True, output_attentions=True)
    outputs = []
    for which in (reference, model):
        which.to(device).eval()
        if in_config:
            for name, value in flags.items():
                setattr(which.config, name, value)
        call = lambda: which(ids, attention_mask=mask, **({} if in_config else flags))
        with torch.no_grad():
            outputs.append(one_scan(call) if which is model else call())
        torch_xla.sync()  # one graph for all the outputs
    expected, actual = outputs
    close(actual.logits, expected.logits, TRAINING)
    assert_same_tuples(actual.hidden_states, expected.hidden_states, LAYERS + 1)
    assert_same_tuples(actual.attentions, expected.attentions,
                       LAYERS if attention == "eager" else 0)
    # Each layer's own: the tuple is not one value repeated.
    assert not torch.allclose(actual.hidden_states[1].cpu(), actual.hidden_states[2].cpu())


def test_hidden_states_selected_by_index_are_the_unconverted_models(device):
    # transformers keeps only the selected hidden states (None in the others' places).
    reference, model = converted_pair()
    ids, mask = batch(device)
    outputs = [which.to(device)(ids, attention_mask=mask, output_hidden_states=[1, -1])
               for which in (reference, model)]
    torch_xla.sync()
    expected, actual = (output.hidden_states for output in outputs)
    assert [state is None for state in actual] == [state is None for state in expected] == [
        True, False, True, False]
    close(actual[1], expected[1], TRAINING)
    close(actual[-1], expected[-1], TRAINING)


@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "empty-dynamic-cache"])
def test_a_loss_on_a_middle_hidden_state_trains_as_one_scan_with_the_unconverted_gradients(
        device, use_cache):
    reference, model = converted_pair(use_cache=use_cache)
    ids, mask = batch(device)
    results = []
    for which in (reference, model):
        which.to(device).train()

        def step():
            output = which(ids, attention_mask=mask, labels=ids, output_hidden_states=True)
            # Distillation-style: pull the middle layer's hidden state towards a target.
            return output.loss + (output.hidden_states[2] - 0.5).pow(2).mean()

        loss = one_scan(step) if which is model else step()
        loss.backward()
        if which is model:
            hlo = torch_xla._XLAC._get_xla_tensors_hlo(
                [loss, *(p.grad for p in model.parameters())])
            assert len(re.findall(r"\bwhile\(", hlo)) == 2  # one forward and one backward loop
        torch_xla.sync()  # one graph for the loss and every gradient
        results.append((loss.detach(), per_layer_grads(which)))
    (expected_loss, expected_grads), (loss, grads) = results
    close(loss, expected_loss, TRAINING)
    close_by_name(grads, expected_grads, TRAINING)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_retained_gradients_of_layers_hidden_states_and_attentions_are_the_unconverted(
        device, family):
    # transformers' test_retain_grad_hidden_states_attentions: the first
    # logit's backward reaches them through the layer's later ops and the
    # later layers, which in the scan is inside its backward loop.
    reference, model = converted_pair(family)
    ids, mask = batch(device)
    retained = {"hidden_states": [0, 1, 2, -1], "attentions": [0, 2]}
    gradients = []
    for which in (reference, model):
        which.to(device)
        output = which(ids, attention_mask=mask, output_hidden_states=True,
                       output_attentions=True)
        tensors = {(name, index): getattr(output, name)[index]
                   for name, indices in retained.items() for index in indices}
        for tensor in tensors.values():
            tensor.retain_grad()
        # A use of its own as well: its gradient adds to what the layers give.
        loss = output.logits.flatten()[0] + output.attentions[2].sum()
        if which is model:
            hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss])
            assert len(re.findall(r"\bwhile\(", hlo)) == 1
        loss.backward()
        gradients.append({key: tensor.grad for key, tensor in tensors.items()})
    expected, actual = gradients
    for key, want in expected.items():
        assert actual[key] is not None, key
        close(actual[key], want, TRAINING)
    # A second backward adds to them, as unconverted.
    output = model(ids, attention_mask=mask, output_attentions=True)
    output.attentions[1].retain_grad()
    output.logits.flatten()[0].backward()
    first = output.attentions[1].grad.clone()
    output = model(ids, attention_mask=mask, output_attentions=True)
    attention = output.attentions[1]
    attention.retain_grad()
    output.logits.flatten()[0].backward(retain_graph=True)
    output.logits.flatten()[0].backward()
    close(attention.grad, 2 * first, TRAINING)


@pytest.mark.parametrize("options", [{}, {"cache_implementation": "static"}],
                         ids=["dynamic-cache", "static-cache"])
def test_generate_returns_the_unconverted_tokens_hidden_states_and_attentions(device, options):
    reference, model = converted_pair(use_cache=True)
    ids, mask = left_padded_prompts((0, 2), device)
    outputs = []
    for which in (reference, model):
        traces_before = tx.cache_info().misses
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", LayerByLayerWarning)
            outputs.append(which.to(device).eval().generate(
                ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                return_dict_in_generate=True, output_hidden_states=True,
                output_attentions=True, **options))
            torch_xla.sync()  # one graph for what generate() returns
    # The prefill's scan and the decoding step's.
    assert tx.cache_info().misses - traces_before == 2
    expected, actual = outputs
    assert torch.equal(actual.sequences.cpu(), expected.sequences.cpu())
    assert len(actual.hidden_states) == len(expected.hidden_states) == 2  # per new token
    for got, want in zip(actual.hidden_states, expected.hidden_states):
        assert_same_tuples(got, want, LAYERS + 1)
    for got, want in zip(actual.attentions, expected.attentions):
        assert_same_tuples(got, want, LAYERS)


def test_layers_run_one_by_one_give_them_too():
    # On the CPU, a call with a cache runs its layers one by one: each layer's
    # own hooks collect them, as unconverted.
    reference, model = converted_pair(use_cache=True)
    ids, mask = batch("cpu")
    expected = reference(ids, attention_mask=mask, output_hidden_states=True,
                         output_attentions=True)
    with pytest.warns(LayerByLayerWarning, match="the layers run on cpu"):
        actual = model(ids, attention_mask=mask, output_hidden_states=True,
                       output_attentions=True)
    assert_same_tuples(actual.hidden_states, expected.hidden_states, LAYERS + 1)
    assert_same_tuples(actual.attentions, expected.attentions, LAYERS)


def test_layers_of_kinds_that_differ_in_more_than_settings_give_them_from_their_scans(device):
    # Kinds that differ in structure: Gemma3's 7 layers as layer 0 by itself
    # and a scan over groups of its pattern, each replaying its layers' hooks.
    reference, model = layer_kinds.converted_pair("gemma3", groups=True, use_cache=True,
                                                  attn_implementation="eager")
    assert tuple(model.model.layers.plan) == layer_kinds.GEMMA3_GROUPS
    ids, mask = batch(device)
    outputs = []
    for which in (reference, model):
        traces_before = tx.cache_info().misses
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", LayerByLayerWarning)
            outputs.append(which.to(device).eval()(ids, attention_mask=mask,
                                                   output_hidden_states=True,
                                                   output_attentions=True))
        torch_xla.sync()  # one graph for all the outputs
    assert tx.cache_info().misses - traces_before == sum(
        not segment.single for segment in layer_kinds.GEMMA3_GROUPS)
    expected, actual = outputs
    assert_same_tuples(actual.hidden_states, expected.hidden_states, 8)
    assert_same_tuples(actual.attentions, expected.attentions, 7)
