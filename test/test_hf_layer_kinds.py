"""stack_layers on transformers models whose layers come in kinds
(config.layer_types: Gemma2, Gemma3, Qwen2 with a sliding window on its
later layers, Olmo3, Exaone4, Lfm2), against the same model unconverted.

Kinds that differ only in settings share one stored segment: they run as one
scan where they compute alike (each layer given its kind's arguments), else
as a scan per run of one kind, or over groups of their pattern. Kinds that
differ in structure (other submodules) are stored as segments, a repeating
pattern as groups of layers that one scan runs a group per step."""
import copy
import re
import warnings

import pytest
import torch
import torch_xla
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from per_layer import per_layer_grads
from support import supports
from test_hf import batch, compilations, left_padded_prompts, seeded_generate
from tolerances import TRAINING, close, close_by_name
import torch_xla_ext as tx
from torch_xla_ext.hf import StackedLayers, stack_layers, unstack_layers
from torch_xla_ext.layer_stack import LayerByLayerWarning
from torch_xla_ext.layer_stack.segments import Segment

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
# The stored segments of Gemma3's layers when its kinds differ in structure
# (`groups`): layer 0 as itself, then two groups of the pattern (sliding, full, sliding).
GEMMA3_GROUPS = (Segment(0, 1, 1), Segment(1, 3, 2))


def another_activation_on_full_attention(model):
    """`model` with its full-attention layers' activation a module of another
    class (torch's tanh GELU for transformers' own): kinds that differ in
    structure, which a stack stores in segments (a repeating pattern as groups)."""
    for layer_type, layer in zip(model.config.layer_types, model.model.layers):
        if layer_type == FULL:
            layer.mlp.act_fn = torch.nn.GELU(approximate="tanh")
    return model


def converted_pair(family, groups=False, **config):
    """An unconverted model and a converted copy with the same weights; with
    `groups`, both with `another_activation_on_full_attention`."""
    torch.manual_seed(0)
    reference = FAMILIES[family](**{**COMMON, **config})
    if groups:
        another_activation_on_full_attention(reference)
    return reference, stack_layers(copy.deepcopy(reference))


def kinds_in_order(layer_types) -> tuple:
    """Each layer's kind, the kinds numbered in order of their first layer (`StackedList.kinds`)."""
    firsts = list(dict.fromkeys(layer_types))
    return tuple(firsts.index(each) for each in layer_types)


def while_loops(*tensors) -> int:
    """The While loops of the graph of `tensors` (not run)."""
    return len(re.findall(r"\bwhile\(", torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))))


@supports("training", FAMILIES)
@supports("default cache", FAMILIES)
@pytest.mark.parametrize("family, groups", [
    ("gemma2", False), ("gemma3", False), ("qwen2", False), ("gemma3", True)],
    ids=["gemma2", "gemma3", "qwen2", "gemma3-groups"])
def test_training_matches_the_unconverted_model_as_one_scan(device, family, groups):
    # use_cache=True, the configs' default: the model makes itself an empty
    # DynamicCache, which the scan fills (its sliding layers keep only their
    # window: the cache's doing, not the layers'). One scan of every layer,
    # each given its kind's arguments; with kinds that differ in structure
    # (`groups`), Gemma3's layer 0 runs as itself, then one scan over groups.
    reference, model = converted_pair(family, groups, use_cache=True)
    layers = model.model.layers
    assert type(layers) is StackedLayers
    assert layers.kinds == kinds_in_order(model.config.layer_types)
    # Kinds that differ in settings only are stored as one segment.
    assert layers.plan == (GEMMA3_GROUPS if groups else (Segment(0, 1, len(layers)),))
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
                # A forward and a backward loop.
                assert while_loops(loss, *(p.grad for p in model.parameters())) == 2
            grads = per_layer_grads(which)
            steps.append((loss.detach(), {k: g.detach().clone() for k, g in grads.items()}))
            optimizer.step()
            torch_xla.sync()
        assert compilations() == compiles_before, "the steady step recompiled"
        results[which is model] = steps
    for (loss, grads), (reference_loss, reference_grads) in zip(results[True], results[False]):
        close(loss, reference_loss, TRAINING)
        close_by_name(grads, reference_grads, TRAINING)


@pytest.mark.parametrize("family, groups", [
    ("gemma2", False), ("gemma3", False), ("qwen2", False), ("gemma3", True)],
    ids=["gemma2", "gemma3", "qwen2", "gemma3-groups"])
def test_state_dict_and_layers_look_unconverted(family, groups, tmp_path):
    reference, model = converted_pair(family, groups)
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
    for index in (len(layers) - 2, len(layers) - 1):  # of either kind
        assert type(layers[index]) is type(reference_layers[index])
        assert (layers[index].self_attn.sliding_window
                == reference_layers[index].self_attn.sliding_window)
        assert type(layers[index].mlp.act_fn) is type(reference_layers[index].mlp.act_fn)
        assert ([name for name, _ in layers[index].named_parameters()]
                == [name for name, _ in reference_layers[index].named_parameters()])
    last = len(layers) - 1
    # A checkpoint of the unconverted model loads under its per-layer keys.
    torch.manual_seed(1)
    other = FAMILIES[family](**COMMON)
    stack_layers(another_activation_on_full_attention(other) if groups else other)
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
def test_a_layer_given_other_arguments_than_its_plan_says_is_refused(device, groups):
    reference, model = converted_pair("gemma2", groups)
    model.to(device).train()
    ids, mask = batch(device)
    model(ids, attention_mask=mask)  # planned: layers 1 and 3 get the full-attention mask
    # Layer 3 is now given the sliding-window mask, which the plan of this kind
    # of call (the config's plain values are alike) says is layer 1's.
    model.config.layer_types = [SLIDING, FULL, SLIDING, SLIDING]
    with pytest.raises(ValueError, match=r"layer 3 is called with another argument \(leaf \d+ "
                                         r"of its arguments\) than layer 1, which the loop gave "
                                         r"the same one when this kind of call was planned"):
        model(ids, attention_mask=mask)
    # A model that gives layer 3 the sliding-window mask from its first call
    # is planned so: each layer gets the mask the forward gives it, in one
    # scan, or in a scan over groups, where a position picks its group's.
    reference, model = converted_pair("gemma2", groups)
    results = []
    for which in (reference, model):
        which.config.layer_types = [SLIDING, FULL, SLIDING, SLIDING]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results.append(which.to(device).train()(ids, attention_mask=mask).logits)
    close(results[1], results[0], TRAINING)
    assert [str(w.message) for w in caught if w.category is LayerByLayerWarning] == []


@pytest.mark.parametrize("family, one_by_one", [("gemma2", 4), ("qwen2", 2)])
def test_a_prefill_fills_the_cache_and_decoding_runs_sliding_layers_one_by_one(device, family,
                                                                               one_by_one):
    # The sliding layers that hold tokens read and update their own slots:
    # they decode one by one (Gemma2's alternate with the full ones: every
    # layer), while a run of full ones (Qwen2's first two) decodes as a scan.
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
    warned = [str(w.message) for w in caught if w.category is LayerByLayerWarning]
    assert len(warned) == 1 and warned[0].startswith(
        f"The {one_by_one} layers ran one by one, as the for loop does, instead of as one scan: "
        f"the key/value cache passed (past_key_values) is of a kind, or in a state, in which "
        f"each layer reads and updates its own slot"), warned
    # Every layer's keys and values, a sliding layer's cut to its window, as unconverted.
    assert [t.shape for t in results[1]] == [t.shape for t in results[0]]
    close(results[1], results[0], TRAINING)


def training_step_of_both(reference, model, device) -> dict:
    """Each model's training step: its loss and gradients by unconverted name
    (`reference`, `model`), and of the converted model's, the
    LayerByLayerWarnings (`one_by_one`) and the While loops of its step's
    graph (`while_loops`)."""
    ids, mask = batch(device)
    results = {}
    for which in (reference, model):
        which.to(device).train()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = which(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        grads = per_layer_grads(which)
        if which is model:
            results["while_loops"] = while_loops(loss, *grads.values())
        torch_xla.sync()  # one graph for the loss and every gradient
        results["model" if which is model else "reference"] = (loss, grads)
    results["one_by_one"] = [str(w.message) for w in caught if w.category is LayerByLayerWarning]
    return results


def assert_same_step(step: dict) -> None:
    (reference_loss, reference_grads), (loss, grads) = step["reference"], step["model"]
    close(loss, reference_loss, TRAINING)
    close_by_name(grads, reference_grads, TRAINING)


def halved_in_sliding_windows(module, query, key, value, attention_mask, sliding_window=None,
                              **kwargs):
    """An attention function of a user's own whose result depends on the layer's kind."""
    output, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return (output * 0.5 if sliding_window is not None else output), weights


@pytest.mark.parametrize("family, scans", [("qwen2", 2), ("gemma2", 1)])
def test_kinds_whose_settings_change_the_computation_run_as_scans_of_one_kind(device, family,
                                                                             scans):
    # Qwen2's kinds come in runs (two full, then two sliding layers): a scan
    # per run. Gemma2's alternate: one scan over groups of the pattern.
    transformers.AttentionInterface.register("halved_in_sliding_windows",
                                             halved_in_sliding_windows)
    # (Gemma2's logits softcapping is eager attention's, which SDPA refuses.)
    reference, model = converted_pair(family, attn_implementation="halved_in_sliding_windows",
                                      attn_logit_softcapping=None)
    assert model.model.layers.plan == (Segment(0, 1, 4),)  # they differ in settings only
    step = training_step_of_both(reference, model, device)
    assert not step["one_by_one"]
    assert step["while_loops"] == 2 * scans
    assert_same_step(step)


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
        results.append((loss, per_layer_grads(which)))
    (reference_loss, reference_grads), (loss, grads) = results
    close(loss, reference_loss, TRAINING)
    close_by_name(grads, reference_grads, TRAINING)
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
def test_kinds_that_differ_in_structure_become_a_scan_over_groups(device):
    torch.manual_seed(0)
    reference = lfm2(**COMMON)
    model = stack_layers(copy.deepcopy(reference))
    assert type(model.model.layers) is StackedLayers
    assert model.model.layers.plan == (Segment(0, 2, 2),)  # two groups of (conv, attention)
    step = training_step_of_both(reference, model, device)
    assert not step["one_by_one"]
    assert step["while_loops"] == 2  # one scan, forward and backward
    assert_same_step(step)


@pytest.mark.parametrize("change, plan, kinds, scans", [
    # Layer 3 (sliding, as layer 0) gets another scaling: a kind of its own,
    # whose program differs, between scans of layers 0-2 and 4-6.
    (lambda layers: setattr(layers[3].self_attn, "scaling", 0.5),
     (Segment(0, 1, 7),), (0, 0, 1, 2, 0, 1, 0), 2),
    # Layer 3 gets a submodule of another class: stored as itself.
    (lambda layers: setattr(layers[3].mlp, "act_fn", torch.nn.GELU(approximate="tanh")),
     (Segment(0, 1, 3), Segment(3, 1, 1), Segment(4, 1, 3)), (0, 0, 1, 2, 0, 1, 0), 2),
], ids=["setting", "submodule"])
def test_a_layer_unlike_the_others_of_its_kind_is_a_kind_of_its_own(device, change, plan, kinds,
                                                                    scans):
    torch.manual_seed(0)
    reference = FAMILIES["gemma3"](**COMMON)
    change(reference.model.layers)
    model = stack_layers(copy.deepcopy(reference))
    assert (model.model.layers.plan, model.model.layers.kinds) == (plan, kinds)
    step = training_step_of_both(reference, model, device)
    assert not step["one_by_one"]
    assert step["while_loops"] == 2 * scans
    assert_same_step(step)


class Block(torch.nn.Module):
    """A layer whose kind "gated" has a submodule more."""

    def __init__(self, gated: bool):
        super().__init__()
        self.norm, self.linear = torch.nn.LayerNorm(4), torch.nn.Linear(4, 4)
        if gated:
            self.gate = torch.nn.Linear(4, 4)

    def forward(self, hidden):
        hidden = self.norm(hidden)
        return self.linear(hidden) * (self.gate(hidden) if hasattr(self, "gate") else 1)


class IteratesOverKinds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(gated=index % 2 == 1) for index in range(4))

    def forward(self, hidden):
        for block in self.blocks:
            hidden = block(hidden)
        return hidden


def test_kinds_that_differ_in_structure_under_an_iterating_loop_are_one_scan_over_groups(
        device):
    torch.manual_seed(0)
    reference = IteratesOverKinds()
    model = stack_layers(copy.deepcopy(reference)).to(device)
    assert model.blocks.plan == (Segment(0, 2, 2),)
    reference.to(device)
    hidden = torch.randn(2, 4, device=device, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayerByLayerWarning)
        output = model(hidden)
    assert while_loops(output) == 1
    close(output, reference(hidden), TRAINING)


@supports("training", OTHER_FAMILIES)
@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_other_families_with_layer_kinds_train_as_unconverted(device, family):
    # Olmo3's kinds compute alike: one scan. Exaone4's sliding layers alone
    # rotate: its last layer, the one full-attention layer, runs as itself
    # after the scan of the others.
    torch.manual_seed(0)
    reference = OTHER_FAMILIES[family](**COMMON)
    model = stack_layers(copy.deepcopy(reference))
    assert type(model.model.layers) is StackedLayers
    assert model.model.layers.plan == (Segment(0, 1, 4),)
    step = training_step_of_both(reference, model, device)
    assert not step["one_by_one"]
    assert step["while_loops"] == 2
    assert_same_step(step)
