"""stack_layers on transformers models whose config.layer_types mixes kinds
(Gemma2, Gemma3, Qwen2 with a sliding window on its later layers), against
the same model unconverted: one scan whose layers pick their kind's
arguments, and the few scans of StackedLayerKinds (for kinds that differ in
more than their settings)."""
import copy
import re
import warnings

import pytest
import torch
import torch_xla
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from support import supports
from test_hf import (batch, compilations, device,  # noqa: F401 (a fixture)
                     left_padded_prompts, per_layer_grads, seeded_generate)
from tolerances import TRAINING, close
import torch_xla_ext as tx
from torch_xla_ext.hf import StackedLayerKinds, StackedLayers, stack_layers, unstack_layers
from torch_xla_ext.layer_stack import LayerByLayerWarning
from torch_xla_ext.layer_stack.groups import Segment, unconverted_name

SLIDING, FULL = "sliding_attention", "full_attention"
# sliding_window 4 < the batch's 8 tokens, so the two kinds of mask differ.
COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, sliding_window=4, use_cache=False)
FAMILIES = {
    # Gemma2's default attention is eager (every kind gets a mask); Gemma3 and
    # Qwen2's SDPA passes full-attention layers None without padding.
    "gemma2": lambda **config: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        num_hidden_layers=4, **config)),
    "gemma3": lambda **config: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        num_hidden_layers=7, layer_types=[SLIDING, SLIDING, FULL] * 2 + [SLIDING], **config)),
    "qwen2": lambda **config: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, max_window_layers=2, **config)),
}
# Families of code elsewhere: Olmo3 loops over a slice of its layers, Exaone4
# iterates over them after a lookup (`layer_type = self.config.layer_types[i]`)
# and applies its rotary table on sliding layers only.
OTHER_FAMILIES = {
    "olmo3": lambda **config: transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
        num_hidden_layers=4, **config)),
    "exaone4": lambda **config: transformers.Exaone4ForCausalLM(transformers.Exaone4Config(
        num_hidden_layers=4, **config)),
}
# The plan of StackedLayerKinds for Gemma3's layers: two groups of the pattern, then one layer.
GEMMA3_GROUPS = [Segment(0, 3, 2), Segment(6, 1, 1)]


def converted_pair(family, groups=False, **config):
    """An unconverted model and a converted copy with the same weights; with
    `groups`, its layers are a StackedLayerKinds, as stack_layers makes for
    kinds that differ in more than their settings."""
    torch.manual_seed(0)
    reference = FAMILIES[family](**{**COMMON, **config})
    model = copy.deepcopy(reference)
    if groups:
        model.model.layers = StackedLayerKinds(model.model.layers, model.config.layer_types,
                                               model.config)
        return reference, model
    return reference, stack_layers(model)


def unconverted_grads(model) -> dict:
    """Every gradient under its parameter's unconverted name."""
    prefix = "model.layers."
    return {prefix + unconverted_name(model.model.layers, name[len(prefix):])
            if name.startswith(prefix) else name: grad
            for name, grad in per_layer_grads(model).items()}


@supports("training", FAMILIES)
@supports("default cache", FAMILIES)
@pytest.mark.parametrize("family, groups", [
    ("gemma2", False), ("gemma3", False), ("qwen2", False), ("gemma3", True)],
    ids=["gemma2", "gemma3", "qwen2", "gemma3-groups"])
def test_training_matches_the_unconverted_model_as_scans(device, family, groups):
    # use_cache=True, the configs' default: the model makes itself an empty
    # DynamicCache, which the scans fill.
    reference, model = converted_pair(family, groups, use_cache=True)
    layers = model.model.layers
    if groups:
        assert layers.plan == GEMMA3_GROUPS
    else:
        assert type(layers) is StackedLayers and {"sliding_window", "layer_type"} <= (
            layers.kind_attributes)
    scans = len(layers.plan) if groups else 1
    ids, mask = batch(device)
    results = {}
    for which in (reference, model):
        which.to(device).train()
        optimizer = torch.optim.AdamW(which.parameters(), lr=1e-2)
        steps = []
        for step in range(3):
            if step == 2:
                compiles_before = compilations()
            optimizer.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("error", LayerByLayerWarning)
                loss = which(ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            if step == 0 and which is model:
                hlo = torch_xla._XLAC._get_xla_tensors_hlo(
                    [loss, *(p.grad for p in model.parameters())])
                # A forward and a backward loop per scan.
                assert len(re.findall(r"\bwhile\(", hlo)) == 2 * scans
            grads = unconverted_grads(which) if which is model else per_layer_grads(which)
            steps.append((loss.detach(), {k: g.detach().clone() for k, g in grads.items()}))
            optimizer.step()
            torch_xla.sync()
        assert compilations() == compiles_before, "the steady step recompiled"
        results[which is model] = steps
    for (loss, grads), (reference_loss, reference_grads) in zip(results[True], results[False]):
        close(loss, reference_loss, TRAINING)
        assert grads.keys() == reference_grads.keys()
        for name, grad in reference_grads.items():
            close(grads[name], grad, TRAINING)


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_and_layers_look_unconverted(family, tmp_path):
    reference, model = converted_pair(family)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded.model.layers) is torch.nn.ModuleList
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    expected, actual = reference.state_dict(), model.state_dict()
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key
    layers, reference_layers = model.model.layers, reference.model.layers
    assert len(layers) == len(reference_layers)
    last = len(layers) - 1
    assert type(layers[last]) is type(reference_layers[last])
    assert layers[last].self_attn.sliding_window == reference_layers[last].self_attn.sliding_window
    assert ([name for name, _ in layers[last].named_parameters()]
            == [name for name, _ in reference_layers[last].named_parameters()])
    # A checkpoint of the unconverted model loads under its per-layer keys.
    torch.manual_seed(1)
    other = stack_layers(FAMILIES[family](**COMMON))
    result = other.load_state_dict(expected)
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in expected.items():
        assert torch.equal(other.state_dict()[key], value), key
    del expected[f"model.layers.{last}.mlp.up_proj.weight"]
    missing = other.load_state_dict(expected, strict=False).missing_keys
    assert missing == [f"model.layers.{last}.mlp.up_proj.weight"]
    unstack_layers(model)
    assert type(model.model.layers) is torch.nn.ModuleList
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.parametrize("groups", [False, True], ids=["one-scan", "groups"])
def test_a_layer_given_another_kinds_arguments_is_refused(device, groups):
    reference, model = converted_pair("gemma2", groups)
    model.to(device).train()
    ids, mask = batch(device)
    # Layer 3 is now given the sliding-window mask; layer 1, the first of its
    # kind (and at its position in the first group), got the full one, which
    # the scan used for layer 3.
    model.config.layer_types = [SLIDING, FULL, SLIDING, SLIDING]
    with pytest.raises(ValueError, match=r"layer 3 is called with other arguments than layer "
                                         r"1, the first layer of its kind: its argument "
                                         r"kwargs\['attention_mask'\] is not the one layer 1 got"):
        model(ids, attention_mask=mask)


@pytest.mark.parametrize("family", ["gemma2", "qwen2"])
def test_a_prefill_fills_the_cache_and_decoding_runs_layer_by_layer(device, family):
    reference, model = converted_pair(family, use_cache=True)
    ids, mask = batch(device)
    step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    results = []
    for which in (reference, model):
        which.to(device).eval()
        with torch.no_grad():
            with warnings.catch_warnings():
                warnings.simplefilter("error", LayerByLayerWarning)
                output = which(ids, attention_mask=mask)
            cache = output.past_key_values
            layers = [t for layer in cache.layers for t in (layer.keys, layer.values)]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step = which(output.logits[:, -1:].argmax(-1), attention_mask=step_mask,
                             past_key_values=cache).logits
        results.append([output.logits, *layers, step])
    # The sliding layers hold 3 tokens (their window, 4, less one), the full ones 8.
    assert any("in which each layer reads and updates its own slot" in str(w.message)
               for w in caught)
    # Every layer's keys and values, a sliding layer's cut to its window, as unconverted.
    assert [t.shape for t in results[1]] == [t.shape for t in results[0]]
    for actual, expected in zip(*results):
        close(actual, expected, TRAINING)

def training_step_of_both(reference, model, device, backward=False) -> tuple:
    """(loss, gradients by unconverted name) of each model's training step,
    and the LayerByLayerWarnings of the converted model's."""
    ids, mask = batch(device)
    results = []
    for which in (reference, model):
        which.to(device).train()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = which(ids, attention_mask=mask, labels=ids).loss
        grads = {}
        if backward:
            loss.backward()
            grads = unconverted_grads(which) if which is model else per_layer_grads(which)
        results.append((loss, grads))
        torch_xla.sync()  # one graph for the loss and every gradient
    return (*results, [str(w.message) for w in caught if w.category is LayerByLayerWarning])


def halved_in_sliding_windows(module, query, key, value, attention_mask, sliding_window=None,
                              **kwargs):
    """An attention function of a user's own whose result depends on the layer's kind."""
    output, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return (output * 0.5 if sliding_window is not None else output), weights


def test_kinds_whose_settings_change_the_computation_run_layer_by_layer(device):
    transformers.AttentionInterface.register("halved_in_sliding_windows",
                                             halved_in_sliding_windows)
    reference, model = converted_pair("qwen2", attn_implementation="halved_in_sliding_windows")
    assert type(model.model.layers) is StackedLayers
    (reference_loss, _), (loss, _), one_by_one = training_step_of_both(reference, model, device)
    assert one_by_one == [
        "The 4 layers ran one by one, as the for loop does, instead of as one scan: the layers' "
        "kinds cannot share one trace: the layer computes another graph with the settings of its "
        "kind 1 than with those of its kind 0."]
    close(loss, reference_loss, TRAINING)


@supports("tx.generate", "qwen2")
def test_generate_with_a_static_cache_of_both_kinds_gives_the_unconverted_tokens(device):
    # The sliding layers' static cache holds 4 positions, the full ones' 14,
    # so the kinds' masks span different keys: each layer gets its own kind's.
    reference, model = converted_pair("qwen2", use_cache=True)
    ids, _ = batch(device)
    tokens = [tx.generate(which.to(device).eval(), ids, max_new_tokens=6)
              for which in (reference, model)]
    assert torch.equal(tokens[1], tokens[0])


@supports("default cache", ("gemma2", "gemma3"))
@supports("generate", ("gemma2", "gemma3"))
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_the_configs_window_and_default_cache_train_and_generate_on_xla_as_scans(device, family):
    # Gemma's window (4096) is longer than the sequence, and its configs say
    # use_cache=True: transformers' DynamicSlidingWindowLayer then slices its
    # keys from before their start, which XLA refuses ("Value out of range").
    # So the unconverted model runs without a cache (training) or with a
    # static one (generation), and the converted one with its defaults.
    reference, model = converted_pair(family, use_cache=True, sliding_window=4096)
    ids, mask = batch(device)
    results = []
    for which, use_cache in ((reference, False), (model, True)):
        which.to(device).train()
        with warnings.catch_warnings():
            warnings.simplefilter("error", LayerByLayerWarning)
            loss = which(ids, attention_mask=mask, labels=ids, use_cache=use_cache).loss
        loss.backward()
        torch_xla.sync()
        results.append((loss, unconverted_grads(which) if which is model
                        else per_layer_grads(which)))
    (reference_loss, reference_grads), (loss, grads) = results
    close(loss, reference_loss, TRAINING)
    assert grads.keys() == reference_grads.keys()
    for name, grad in reference_grads.items():
        close(grads[name], grad, TRAINING)
    prompts, prompt_mask = left_padded_prompts((0, 2), device)
    expected = seeded_generate(reference, prompts, prompt_mask, cache_implementation="static")
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayerByLayerWarning)
        assert seeded_generate(model, prompts, prompt_mask) == expected


@supports("generate", ("gemma2", "qwen2"))
@supports("tx.generate", ("gemma2", "qwen2"))
@pytest.mark.parametrize("family", ["gemma2", "qwen2"])
def test_generate_with_a_static_cache_within_the_window_scans_every_step(device, family):
    # The configs' window (4096) holds the whole cache: its sliding layers hold
    # as many positions as its full ones and update as they do, so the prefill
    # and each decoding step of either generate are one scan of both kinds.
    reference, model = converted_pair(family, use_cache=True, sliding_window=4096)
    ids, mask = left_padded_prompts((0, 2), device)
    tokens = []
    for which in (reference, model):
        traces_before = tx.cache_info().misses
        with warnings.catch_warnings():
            warnings.simplefilter("error", LayerByLayerWarning)
            tokens.append((seeded_generate(which, ids, mask, cache_implementation="static"),
                           tx.generate(which, ids, 3, attention_mask=mask).cpu().tolist()))
    assert tokens[1] == tokens[0]
    assert tokens[0][0] == [row[:-1] for row in tokens[0][1]]  # the same 2 first tokens
    # generate()'s and tx.generate's prefill and decoding step (other masks).
    assert tx.cache_info().misses - traces_before == 4


def lfm2(**config):
    """Lfm2: its short-convolution and attention layers are of one class, with other
    submodules (`conv`, `self_attn`): kinds that differ in structure."""
    return transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
        num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2, **config))


@supports("training", "lfm2")
def test_kinds_that_differ_in_structure_become_a_scan_per_segment(device):
    torch.manual_seed(0)
    reference = lfm2(**COMMON)
    model = stack_layers(copy.deepcopy(reference))
    assert type(model.model.layers) is StackedLayerKinds
    assert model.model.layers.plan == [Segment(0, 2, 2)]
    (reference_loss, reference_grads), (loss, grads), one_by_one = training_step_of_both(
        reference, model, device, backward=True)
    assert not one_by_one
    close(loss, reference_loss, TRAINING)
    assert grads.keys() == reference_grads.keys()
    for name, grad in reference_grads.items():
        close(grads[name], grad, TRAINING)


def test_layers_of_one_kind_not_alike_are_refused_as_such_not_as_groups():
    # Layer 3, a sliding one as layer 0, has another scaling: a defect of the
    # layers, which the one scan's check names (kinds that differ only in
    # settings are never stacked as groups instead).
    torch.manual_seed(0)
    model = FAMILIES["gemma3"](**COMMON)
    model.model.layers[3].self_attn.scaling = 0.5
    with pytest.raises(ValueError, match=r"cannot stack the layers at 'model\.layers': Layer 3 "
                                         r"setting 'self_attn\.scaling' is 0\.5") as refused:
        stack_layers(model)
    assert "group" not in str(refused.value)
    assert type(model.model.layers) is torch.nn.ModuleList


class Block(torch.nn.Module):
    """A layer whose kind "gated" has a submodule more."""

    def __init__(self, gated: bool):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        if gated:
            self.gate = torch.nn.Linear(4, 4)

    def forward(self, hidden):
        return self.linear(hidden) * (self.gate(hidden) if hasattr(self, "gate") else 1)


class IteratesOverKinds(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.config = transformers.PretrainedConfig(layer_types=["plain", "gated"] * 2)
        self.blocks = torch.nn.ModuleList(Block(gated=index % 2 == 1) for index in range(4))

    def forward(self, hidden):
        for block in self.blocks:
            hidden = block(hidden)
        return hidden


def test_kinds_that_differ_in_structure_under_an_iterating_loop_are_refused():
    with pytest.raises(ValueError, match=r"several kinds \(config\.layer_types: \['gated', "
                                         r"'plain'\]\) that differ in more than their settings "
                                         r"\(Layer 1 differs from layer 0: it has extra "
                                         r"submodules \['gate'\].*IteratesOverKinds\.forward "
                                         r"iterates over them"):
        stack_layers(IteratesOverKinds())


@supports("training", OTHER_FAMILIES)
@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_other_families_with_layer_kinds_train_as_unconverted(device, family):
    # One scan where the kinds compute alike (Olmo3); where they do not
    # (Exaone4's sliding layers alone rotate), the layers run one by one.
    torch.manual_seed(0)
    reference = OTHER_FAMILIES[family](**COMMON)
    model = stack_layers(copy.deepcopy(reference))
    assert type(model.model.layers) is StackedLayers
    (reference_loss, reference_grads), (loss, grads), one_by_one = training_step_of_both(
        reference, model, device, backward=True)
    if family == "exaone4":
        assert len(one_by_one) == 1 and "kinds cannot share one trace" in one_by_one[0]
    else:
        assert not one_by_one
    close(loss, reference_loss, TRAINING)
    assert grads.keys() == reference_grads.keys()
    for name, grad in reference_grads.items():
        close(grads[name], grad, TRAINING)
