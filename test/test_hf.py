"""stack_layers on unmodified transformers causal LMs, against the same model unconverted."""
import copy
import glob
import io
import os
import re
import warnings

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import transformers
from safetensors.torch import load_file
from torch import nn

import torch_xla_ext as tx
from support import supports
from optimized_hlo import (
    callees, computations, dump_flags, entry_computation, stacked_results_in_loops, while_loops)
from reference import host_copies
from per_layer import per_layer_grads
from tolerances import LOGGED_LOSSES, TRAINING, close, close_by_name
from torch_xla_ext.hf import StackedLayers, cache_plan, stack_layers, unstack_layers
from torch_xla_ext.layer_stack import LayerByLayerWarning, StackedList
from torch_xla_ext.layer_stack.storage import storage_of
from torch_xla_ext.layer_stack.scan_runner import device_reason

VOCAB, SEQ, BATCH = 128, 8, 2
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}


def make_model(family="llama", layers=4, seed=0, **config):
    config_class, model_class = FAMILIES[family]
    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                    use_cache=False, sliding_window=None)
    torch.manual_seed(seed)
    return model_class(config_class(**{**settings, **config}))


def make_diffllama(layers=3, **config):
    """A small DiffLlama, whose attention layers differ in a number of their
    arithmetic (`lambda_init`, from the layer's index)."""
    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                    max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    return transformers.DiffLlamaForCausalLM(transformers.DiffLlamaConfig(**{**settings,
                                                                           **config}))


def converted_pair(family="llama", layers=4, **config):
    """An unconverted model and a converted copy with the same weights."""
    model = make_model(family, layers, **config)
    return model, stack_layers(copy.deepcopy(model))


def batch(device, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :2] = 0  # left padding in one row
    return ids.to(device), mask.to(device)


def compilations() -> int:
    return (met.metric_data("CompileTime") or (0,))[0]


# ---------------------------------------------------------------------------
# Training


@supports("training", FAMILIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_training_matches_the_unconverted_model(device, family):
    reference, model = converted_pair(family, layers=3)
    assert type(model.model.layers) is StackedLayers and len(model.model.layers) == 3
    ids, mask = batch(device)
    compiled = {}
    for which in (reference, model):
        which.to(device).train()
        optimizer = torch.optim.AdamW(which.parameters(), lr=1e-2)
        cache_before = tx.cache_info()
        losses, grads = [], []
        for step in range(4):
            if step == 2:
                compiles_before = compilations()
            optimizer.zero_grad(set_to_none=True)
            loss = which(ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
            grads.append({k: g.detach().clone() for k, g in per_layer_grads(which).items()})
            optimizer.step()
            torch_xla.sync()
        # Step 0 builds AdamW's state and step 1 is the steady graph: no step after recompiles.
        compiled[which is model] = compilations() - compiles_before
        cache_after = tx.cache_info()
        if which is model:
            # One trace of the layer for all four steps: a miss, then hits.
            assert cache_after.misses - cache_before.misses == 1
            assert cache_after.hits - cache_before.hits == 3
        else:
            reference_losses, reference_grads = losses, grads
    assert compiled == {False: 0, True: 0}
    for step in range(4):
        close(losses[step], reference_losses[step], TRAINING)
        close_by_name(grads[step], reference_grads[step], TRAINING)
    close_by_name(model.state_dict(), reference.state_dict(), TRAINING)


# Models whose forward iterates over the layers (`for i, block in enumerate(self.h)`).
# (GPT-2 passes its cache by position, GPT-NeoX as `layer_past`.)
ITERATING = {
    "gpt2": lambda use_cache: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=use_cache, bos_token_id=0, eos_token_id=0)),
    "gpt_neox": lambda use_cache: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=64, hidden_dropout=0.0, attention_dropout=0.0, use_cache=use_cache)),
}


@supports("training", ITERATING)
@supports("default cache", ITERATING)
@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "default-cache"])
@pytest.mark.parametrize("family", ITERATING)
def test_forwards_that_iterate_over_the_layers_train_as_one_scan(device, family, use_cache):
    torch.manual_seed(0)
    reference = ITERATING[family](use_cache)
    model = stack_layers(copy.deepcopy(reference))
    assert_one_scan_with_the_unconverted_step(reference, model, device)
    # Iterating over the layers outside the model's forward still gives each layer.
    layers = [layer for layer in model.get_submodule(
        "transformer.h" if family == "gpt2" else "gpt_neox.layers")]
    assert len(layers) == 4 and all(type(layer) is not type(model) for layer in layers)
    assert type(layers[1]).__name__ in ("GPT2Block", "GPTNeoXLayer")


@pytest.mark.parametrize("layers, option, value, kept", [
    (2, "partition_fn", "save_nothing", tx.policies.save_nothing),
    (3, "unroll", 2, 2),  # 2 layers per iteration of the loops, the third after them
], ids=["policy", "unroll"])
def test_an_option_given_to_stack_layers_gives_the_unconverted_gradients(device, layers, option,
                                                                         value, kept):
    reference = make_model("llama", layers=layers)
    model = stack_layers(copy.deepcopy(reference), **{option: value})
    assert getattr(model.model.layers, option) is kept
    assert model.model.layers.stack_options()[option] is kept
    ids, mask = batch(device)
    grads = []
    for which in (reference, model):
        which.to(device).train()
        loss = which(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        torch_xla.sync()  # one execution; reading each gradient alone would compile each
        grads.append((loss.detach(), per_layer_grads(which)))
    close(grads[1][0], grads[0][0], TRAINING)
    close_by_name(grads[1][1], grads[0][1], TRAINING)


def training_step_hlo(model, device) -> tuple[str, torch.Tensor]:
    """The HLO of a training step's loss and gradients (not run), and the loss."""
    model.to(device).train()
    ids, mask = batch(device)
    loss = model(ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return torch_xla._XLAC._get_xla_tensors_hlo([loss, *step_gradients(model)]), loss


def step_gradients(model) -> list[torch.Tensor]:
    """The gradients a training step's sync computes: each stacked tensor's,
    whose slices the layers' Parameters hold as views, and the others'."""
    stacked = [tensor.grad for module in model.modules() if isinstance(module, StackedList)
               for stack in module.stacks() for tensor in stack.storage.stacked.values()
               if tensor.grad is not None]
    return stacked + [p.grad for p in model.parameters()
                      if p.grad is not None and storage_of(p) is None]


def instruction_count(hlo: str) -> int:
    return len(re.findall(r"^\s*(?:ROOT )?%\S+ = ", hlo, re.MULTILINE))


def test_16_layers_train_as_one_while_loop_like_the_unconverted_model(device):
    sizes, results = {}, []
    for layers in (4, 16):
        for which in converted_pair(layers=layers):
            converted = isinstance(which.model.layers, StackedLayers)
            hlo, loss = training_step_hlo(which, device)
            sizes[layers, converted] = instruction_count(hlo)
            assert bool(re.search(r"\bwhile\(", hlo)) == converted
            if layers == 16:
                torch_xla.sync()
                results.append((loss, per_layer_grads(which)))
            else:
                which.zero_grad(set_to_none=True)  # drops the step unrun
    # The converted step does not grow with the layers; the for loop's copies of the layer do.
    assert sizes[16, True] == sizes[4, True]
    assert sizes[16, False] > 3 * sizes[4, False]
    (reference_loss, reference_grads), (loss, grads) = results
    close(loss, reference_loss, TRAINING)
    close_by_name(grads, reference_grads, TRAINING)


# ---------------------------------------------------------------------------
# Checkpoints and per-layer access


def test_state_dict_and_layers_look_unconverted():
    reference, model = converted_pair()
    expected, actual = reference.state_dict(), model.state_dict()
    assert list(actual) == list(expected)
    assert "model.layers.3.self_attn.q_proj.weight" in actual
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key
    assert [name for name, _ in model.named_parameters()] == [
        name for name, _ in reference.named_parameters()]
    stacked = model.model.layers.segments[0].storage.stacked
    assert stacked["self_attn.q_proj.weight"].shape == (4, 32, 32)
    layer = model.model.layers[3]
    assert type(layer) is type(reference.model.layers[3])
    assert torch.equal(layer.mlp.up_proj.weight, reference.model.layers[3].mlp.up_proj.weight)
    assert [type(m) for m in model.model.layers] == [type(m) for m in reference.model.layers]


def test_save_pretrained_loads_as_an_unconverted_model(device, tmp_path):
    _, model = converted_pair()
    model.to(device).train()
    ids, mask = batch(device)
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    torch_xla.sync()
    # safetensors reads tensors' host storage, which XLA tensors lack (the same for an
    # unconverted model): transformers users save from the CPU.
    model.cpu()
    expected = {key: value.clone() for key, value in model.state_dict().items()}
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded.model.layers) is nn.ModuleList
    actual = loaded.state_dict()
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def test_converted_model_loads_an_unconverted_checkpoint(tmp_path):
    reference = make_model(seed=0)
    reference.save_pretrained(tmp_path)
    model = stack_layers(make_model(seed=1))
    result = model.load_state_dict(load_file(os.path.join(tmp_path, "model.safetensors")))
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    loaded = stack_layers(transformers.AutoModelForCausalLM.from_pretrained(tmp_path))
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


# ---------------------------------------------------------------------------
# Generation with a key/value cache


def generate(model, ids, mask):
    return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                          use_cache=True, pad_token_id=0)


@supports("generate", FAMILIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_generation_with_a_cache_gives_the_unconverted_tokens(family):
    reference, model = converted_pair(family)
    ids, mask = batch("cpu")
    with torch.no_grad():
        expected = generate(reference.eval(), ids, mask)
        with pytest.warns(LayerByLayerWarning, match="the layers run on cpu"):
            actual = generate(model.eval(), ids, mask)
    assert expected.shape == (BATCH, SEQ + 8)
    assert torch.equal(actual, expected)


def left_padded_prompts(padding, device):
    """Prompts of SEQ tokens, row i padded on the left by padding[i] tokens."""
    ids = torch.randint(1, VOCAB, (len(padding), SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0] * pad + [1] * (SEQ - pad) for pad in padding])
    return ids.to(device), mask.to(device)


def seeded_generate(model, ids, mask, **options) -> list:
    """2 new tokens (a prefill and a decoding step; each token compiles) from
    generate() on the prompts' device, every RNG seeded."""
    torch.manual_seed(0)
    xm.set_rng_state(0)
    with torch.no_grad():
        return model.to(ids.device).eval().generate(
            ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, **options).cpu().tolist()


GREEDY = dict(do_sample=False)
# What generate() is asked for, as users call it, with the default cache: greedy
# for Qwen2, Llama with three prompts of different lengths padded on the left,
# and Mistral with its sliding window on, shorter than the prompt. The prefill
# and each decoding step are scans, but a window that drops tokens makes the
# decoding steps run layer by layer. The static-cache cases are below.
GENERATIONS = {
    "qwen2": ("qwen2", {}, GREEDY, (0, 2), True),
    "three-prompts": ("llama", {}, GREEDY, (0, 3, 5), True),
    "mistral-sliding": ("mistral", {"sliding_window": 4}, GREEDY, (0, 2), False),
}


@supports("default cache", (case[0] for case in GENERATIONS.values()))
@supports("generate", (case[0] for case in GENERATIONS.values()))
@pytest.mark.parametrize("family, config, options, padding, scanned_steps", GENERATIONS.values(),
                         ids=GENERATIONS)
def test_generation_with_the_default_cache_gives_the_unconverted_tokens_as_scans(
        device, family, config, options, padding, scanned_steps):
    reference, model = converted_pair(family, layers=2, use_cache=True, **config)
    ids, mask = left_padded_prompts(padding, device)
    tokens = []
    for which in (reference, model):
        traces_before = tx.cache_info().misses
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tokens.append(seeded_generate(which, ids, mask, **options))
    assert tokens[1] == tokens[0]
    reasons = {str(w.message) for w in caught if w.category is LayerByLayerWarning}
    if scanned_steps:  # the prompt's prefill and the decoding step
        assert tx.cache_info().misses - traces_before == 2 and not reasons
    else:  # the prompt's prefill; the step's cache layers hold 3 tokens, a window's less one
        assert tx.cache_info().misses - traces_before == 1
        assert len(reasons) == 1 and "a window drops tokens" in reasons.pop()


@supports("default cache", "llama")
def test_training_with_the_default_cache_is_one_scan_with_the_unconverted_gradients(device):
    # use_cache=True, most configs' default: the model makes itself a DynamicCache.
    assert_one_scan_with_the_unconverted_step(*converted_pair(use_cache=True), device)


def assert_one_scan_with_the_unconverted_step(reference, model, device):
    """A training step of `model` runs its layers as one scan, with no
    LayerByLayerWarning, and gives `reference`'s loss and every gradient."""
    ids, mask = batch(device)
    results = []
    for which in (reference, model):
        which.to(device).train()
        with warnings.catch_warnings():
            warnings.simplefilter("error", LayerByLayerWarning)
            loss = which(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss])
        grads = per_layer_grads(which)
        results.append((hlo, dict(zip(["loss", *grads], host_copies([loss, *grads.values()])))))
    (reference_hlo, expected), (hlo, actual) = results
    assert "while" in hlo and "while" not in reference_hlo
    close_by_name(actual, expected, TRAINING)


@pytest.mark.parametrize("family, config", [
    ("llama", {}), ("mistral", {"sliding_window": 4}), ("qwen2", {})], ids=["llama", "mistral-sliding", "qwen2"])
def test_a_prefill_with_a_cache_is_one_scan_that_fills_the_cache(device, family, config):
    reference, model = converted_pair(family, use_cache=True, **config)
    ids, mask = batch(device)
    outputs = []
    for which in (reference, model):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", LayerByLayerWarning)
            output = which.to(device).eval()(ids, attention_mask=mask)
        cache = output.past_key_values
        tensors = [output.logits, *(t for layer in cache.layers for t in (layer.keys, layer.values))]
        outputs.append((cache, host_copies(tensors)))
    (reference_cache, expected), (cache, actual) = outputs
    assert type(cache) is type(reference_cache)
    # Layers of the same classes (a subclass of the same name, which reads the
    # stacked keys and values from the scan, where the cache keeps all it got).
    assert all(isinstance(layer, type(reference_layer)) and type(layer).__name__
               == type(reference_layer).__name__
               for layer, reference_layer in zip(cache.layers, reference_cache.layers, strict=True))
    assert cache.get_seq_length() == reference_cache.get_seq_length() == SEQ
    assert len(actual) == len(expected) == 1 + 2 * 4  # logits, then every layer's keys and values
    for tensor, expected_tensor in zip(actual, expected):
        close(tensor, expected_tensor, TRAINING)


def test_decoding_steps_over_a_dynamic_cache_are_scans_with_the_unconverted_logits_and_cache(
        device):
    reference, model = converted_pair(use_cache=True)
    ids, mask = batch(device)
    results = []
    for which in (reference, model):
        which.to(device).eval()
        with torch.no_grad():
            output = which(ids, attention_mask=mask)
        cache, step_mask, logits = output.past_key_values, mask, [output.logits]
        one_by_one = []
        for grad in (False, False, True):
            if grad:  # what the cache's layers hold after the prefill and two steps
                held = {id(value): value for layer in cache.layers
                        for value in vars(layer).values() if isinstance(value, torch.Tensor)}
            step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], dim=1)
            with torch.set_grad_enabled(grad), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                logits.append(which(logits[-1][:, -1:].argmax(-1), attention_mask=step_mask,
                                    past_key_values=cache).logits)
            one_by_one.append([str(w.message) for w in caught
                               if w.category is LayerByLayerWarning])
        layers = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        results.append((cache.get_seq_length(), host_copies([*logits, *layers])))
    (expected_length, expected), (length, actual) = results
    assert length == expected_length == SEQ + 3
    # The converted model's cache layers read two stacked buffers, which each
    # step's scan extends; they hold no tensor of their own.
    assert sorted(tuple(t.shape) for t in held.values()) == [(4, BATCH, 2, SEQ + 2, 8)] * 2
    # The step with gradients runs layer by layer: the scan reads the held keys
    # and values without theirs.
    assert one_by_one == [[], [], [
        "The 4 layers ran one by one, as the for loop does, instead of as one scan: "
        f"{cache_plan.DYNAMIC_GRADIENTS_REASON}."]]
    assert len(actual) == len(expected) == 4 + 2 * 4
    for got, want in zip(actual, expected):
        close(got, want, TRAINING)


# Mistral samples with its config's sliding window (4096: the cache holds
# fewer positions, so its layers update as full-attention ones do).
def test_a_dynamic_cache_of_other_forms_and_uses_keeps_the_unconverted_results(device):
    reference, model = converted_pair(layers=2, use_cache=True)
    ids, mask = batch(device)
    # Frozen layers, trainable input embeddings: a decoding step's keys and
    # values carry gradients to the step's inputs, so it runs layer by layer
    # (the prompt's, under no_grad, carry none).
    embeddings = torch.randn(BATCH, SEQ + 2, 32, generator=torch.Generator().manual_seed(2))
    results = []
    for which in (reference, model):
        which.to(device).eval().requires_grad_(False)
        # A cache made up front (`early_initialization`: empty 1-d tensors).
        early = transformers.DynamicCache(config=which.config)
        early.early_initialization(batch_size=BATCH, num_heads=2, head_dim=8,
                                   dtype=torch.float32, device=device)
        with torch.no_grad():
            prefill = which(ids, attention_mask=mask, past_key_values=early).logits
        prompt, first, second = (part.to(device).requires_grad_()
                                 for part in embeddings.split([SEQ, 1, 1], dim=1))
        cache = transformers.DynamicCache(config=which.config)
        with torch.no_grad():
            which(inputs_embeds=prompt, past_key_values=cache)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            which(inputs_embeds=first, past_key_values=cache)
            which(inputs_embeds=second, past_key_values=cache).logits.sum().backward()
        results.append(host_copies([prefill, first.grad, second.grad]))
    for got, want in zip(*results):
        close(got, want, TRAINING)
    assert sum(w.category is LayerByLayerWarning for w in caught) == 2
    # The filled cache saves with torch.save, its layers as transformers' own.
    with torch.no_grad():
        cache = model(ids, attention_mask=mask).past_key_values
    saved = io.BytesIO()
    torch.save(cache, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert [type(layer) for layer in loaded.layers] == [transformers.DynamicLayer] * 2
    for layer, loaded_layer in zip(cache.layers, loaded.layers):
        close(loaded_layer.keys, layer.keys, TRAINING)
        close(loaded_layer.values, layer.values, TRAINING)


def reasons_and_logits(model, ids, mask, cache, grad=False) -> tuple[list, torch.Tensor]:
    """The reasons of the LayerByLayerWarnings of a call of `model` with
    `cache`, and its logits."""
    with torch.set_grad_enabled(grad), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = model(ids, attention_mask=mask, past_key_values=cache).logits
    ran = (f"The {model.config.num_hidden_layers} layers ran one by one, as the for loop does, "
           f"instead of as one scan: ")
    return [str(w.message).removeprefix(ran).removesuffix(".") for w in caught
            if w.category is LayerByLayerWarning], logits


def test_every_reason_of_a_cache_call_is_reached_with_the_unconverted_logits(device):
    # Mistral with a window of SEQ + 2: a DynamicCache layer keeps SEQ + 1
    # tokens, a StaticCache layer holds SEQ + 2 positions. The unconverted
    # model runs on the CPU: on XLA, its DynamicCache's window slices from
    # before the start of the prefill's keys, which XLA refuses.
    reference, model = converted_pair("mistral", layers=2, use_cache=True,
                                      sliding_window=SEQ + 2)
    ids, mask = batch("cpu")
    step = ids[:, -1:]  # the same tokens for both models
    inputs = (ids, mask, step, *(torch.cat([mask, torch.ones(BATCH, more, dtype=mask.dtype)],
                                           dim=1) for more in (1, 2)))
    results = []
    for which, where in ((reference.eval(), "cpu"), (model.eval(), device)):
        calls = [reasons_and_logits(which, ids, mask,
                                    transformers.DynamicCache(config=which.config))]
        which.to(where)
        prompt, prompt_mask, token, one_more, two_more = (each.to(where) for each in inputs)
        dynamic = transformers.DynamicCache(config=which.config)
        static = transformers.StaticCache(config=which.config, max_cache_len=SEQ + 4)
        calls += [
            reasons_and_logits(which, prompt, prompt_mask, dynamic),
            # Decoding with gradients through what the cache holds.
            reasons_and_logits(which, token, one_more, dynamic, grad=True),
            # SEQ + 2 tokens: the window drops one.
            reasons_and_logits(which, token, two_more, dynamic),
            reasons_and_logits(which, prompt, prompt_mask, static),
            reasons_and_logits(which, token, one_more, static, grad=True)]
        results.append(calls)
    expected, actual = results
    assert [reasons for reasons, _ in expected] == [[]] * 6
    reached = [reasons for reasons, _ in actual]
    on_cpu = device_reason(torch.device("cpu"))
    assert reached == [[on_cpu], [],
                       [cache_plan.DYNAMIC_GRADIENTS_REASON], [cache_plan.CACHE_REASON], [],
                       [cache_plan.STATIC_GRADIENTS_REASON]]
    # Every reason a call with a cache can give, reached.
    assert {reason for reasons in reached for reason in reasons} == {on_cpu, *cache_plan.REASONS}
    close([logits for _, logits in actual], [logits for _, logits in expected], TRAINING)


STATIC = {
    "qwen3": ("qwen3", {}, GREEDY, (0, 2)),
    "mistral-window-sampling": ("mistral", {"sliding_window": 4096},
                                dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9), (0, 2)),
    "beam-search": ("llama", {}, dict(do_sample=False, num_beams=2), (0, 2)),
    "three-prompts": ("llama", {}, GREEDY, (0, 3, 5)),
}


@supports("generate", (case[0] for case in STATIC.values()))
@pytest.mark.parametrize("family, config, options, padding", STATIC.values(), ids=STATIC)
def test_generation_with_a_static_cache_runs_the_prefill_and_every_step_as_one_scan(
        device, family, config, options, padding):
    reference, model = converted_pair(family, layers=2, use_cache=True, **config)
    ids, mask = left_padded_prompts(padding, device)
    tokens = []
    for which in (reference, model):
        traces_before = tx.cache_info().misses
        with warnings.catch_warnings():
            warnings.simplefilter("error", LayerByLayerWarning)
            tokens.append(seeded_generate(which, ids, mask, cache_implementation="static",
                                          **options))
    assert tokens[1] == tokens[0]
    # Two traces: the prefill fills the empty cache; the decoding steps write it.
    assert tx.cache_info().misses - traces_before == 2


def test_a_static_cache_keeps_its_api_over_stacked_buffers(device):
    reference, model = converted_pair(use_cache=True)
    ids, mask = batch(device)
    results = []
    for which in (reference, model):
        which.to(device).eval()
        cache = transformers.StaticCache(config=which.config, max_cache_len=SEQ + 4)
        outputs = []
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", LayerByLayerWarning)
            for _ in range(2):  # the second time over the cache after reset()
                step_mask, step_ids = mask, ids
                logits = []
                for step in range(3):
                    logits.append(which(step_ids, attention_mask=step_mask,
                                        past_key_values=cache).logits)
                    if step == 0:
                        # Held over the next steps, a layer's keys show their writes, as
                        # the unconverted layer's own tensor does.
                        held_keys = cache.layers[1].keys
                    step_ids = logits[-1][:, -1:].argmax(-1)
                    step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], 1)
                layers = [t for layer in cache.layers for t in (layer.keys, layer.values)]
                # Copies: reset() zeroes the cache's tensors in place.
                outputs.append([t.clone() for t in (cache.get_seq_length(), *logits, *layers,
                                                    held_keys)])
                cache.reset()
            outputs.append([*(layer.keys for layer in cache.layers), cache.get_seq_length()])
        results.append(host_copies([t for group in outputs for t in group]))
    expected, actual = results
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        close(got, want, TRAINING)
    assert expected[0].item() == SEQ + 2 and expected[-1].item() == 0
    # The cache's layers hold the two stacked buffers and their lengths, no
    # view of a slice: torch_xla materializes a live view at each sync, which
    # would be a second copy of the cache.
    held = {id(value): value for layer in cache.layers for value in vars(layer).values()
            if isinstance(value, torch.Tensor)}
    layers = len(model.model.layers)
    assert sorted(tuple(t.shape) for t in held.values() if t.dim()) == [
        (layers, BATCH, 2, SEQ + 4, 8)] * 2
    assert len(held) == 2 + layers
    # reset() zeroed every layer's keys: the stacked buffers, through the views.
    assert not any(keys.any() for keys in actual[-1 - len(model.model.layers):-1])


def test_a_sliding_window_static_cache_is_scanned_until_its_window_is_full(device):
    # Mistral's StaticCache layers hold a window of SEQ + 2 positions: the
    # prefill and two decoding steps fit in it and are scans writing the
    # stacked buffers; the third drops the oldest position (transformers'
    # roll), which runs layer by layer over the same buffers.
    reference, model = converted_pair("mistral", layers=2, use_cache=True,
                                      sliding_window=SEQ + 2)
    ids, mask = batch(device)
    results = []
    for which in (reference, model):
        which.to(device).eval()
        cache = transformers.StaticCache(config=which.config, max_cache_len=SEQ + 4)
        step_ids, step_mask, logits, one_by_one = ids, mask, [], []
        with torch.no_grad():
            for _ in range(4):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    logits.append(which(step_ids, attention_mask=step_mask,
                                        past_key_values=cache).logits)
                one_by_one.append([str(w.message) for w in caught
                                   if w.category is LayerByLayerWarning])
                step_ids = logits[-1][:, -1:].argmax(-1)
                step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], 1)
        layers = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        results.append((cache.get_seq_length(), one_by_one, host_copies([*logits, *layers])))
    (expected_length, _, expected), (length, one_by_one, actual) = results
    assert length == expected_length == SEQ + 3
    assert one_by_one[:3] == [[], [], []]
    assert len(one_by_one[3]) == 1 and "a window drops tokens" in one_by_one[3][0]
    assert len(actual) == len(expected) == 4 + 2 * 2
    for got, want in zip(actual, expected):
        close(got, want, TRAINING)


def static_decoding_scenario():
    """Prefill then two decoding steps of a converted Llama into a StaticCache."""
    device = torch_xla.device()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2)
    model = tx.stack_layers(transformers.LlamaForCausalLM(config)).to(device).eval()
    cache = transformers.StaticCache(config=config, max_cache_len=16)
    with torch.no_grad():
        token = model(torch.randint(1, 128, (2, 8)).to(device), past_key_values=cache).logits
        torch_xla.sync()
        for _ in range(2):
            token = model(token[:, -1:].argmax(-1), past_key_values=cache).logits
            torch_xla.sync()


def test_a_decoding_step_writes_only_the_new_positions_of_the_stacked_cache(run_isolated,
                                                                           tmp_path):
    flags = dump_flags(tmp_path)
    result = run_isolated(static_decoding_scenario, env={"XLA_FLAGS": flags})
    assert result.returncode == 0, result.stderr[-3000:]
    cache_shape = "f32[3,2,2,16,8]"  # [layers, batch, kv heads, max_cache_len, head_dim]
    dumps = [open(path).read() for path in glob.glob(f"{tmp_path}/*after_optimizations.txt")]
    # The decoding steps' graphs: their loops carry the stacked cache.
    steps = [hlo for hlo in dumps
             if any(("f32", "3,2,2,16,8") in stacked for _, stacked in while_loops(hlo, 3))]
    assert steps
    for step in steps:
        in_loop = [(name, opcode, line) for name, opcode, line
                   in stacked_results_in_loops(step, 3) if f"= {cache_shape}" in line]
        # Read, and written by scatters of the new positions' rows: no copy, no
        # whole layer written back.
        assert {opcode for _, opcode, _ in in_loop} == {
            "parameter", "get-tuple-element", "fusion", "scatter"}, in_loop
        found = computations(step)
        for _, opcode, line in in_loop:
            if opcode == "fusion":
                fused, = callees(line)
                assert " scatter(" in found[fused][-1], found[fused]
        # Nor outside it: the loop writes the keys and values in their own
        # buffers, which the step gets back as its outputs.
        whole_copies = [line for line in entry_computation(step)
                        if re.search(rf"= {re.escape(cache_shape)}\S* copy\(", line)]
        assert not whole_copies, whole_copies


# ---------------------------------------------------------------------------
# What is refused


def test_on_the_cpu_the_layers_run_one_by_one_with_the_unconverted_logits():
    # A converted model moved to the CPU (to be saved, say) still runs, without
    # a cache too: the scan is an XLA loop, so its layers run one by one.
    reference, model = converted_pair(layers=2)
    ids, mask = batch("cpu")
    with pytest.warns(LayerByLayerWarning, match="the layers run on cpu, and the scan is an XLA "
                                                 "loop"):
        logits = model(ids, attention_mask=mask).logits
    close(logits, reference(ids, attention_mask=mask).logits, TRAINING)


def forward_while_loops(model, ids) -> int:
    """The While loops of a forward's graph (not run): one per scan."""
    return torch_xla._XLAC._get_xla_tensors_hlo([model(ids).logits]).count(" while(")


@pytest.mark.parametrize("change, scans, warned", [
    # A setting changed on layer 1 that changes its graph (another GELU):
    # layers 0 and 1 compute differently from each other and run one by one,
    # saying which setting sets them apart; 2-3 are one scan.
    (lambda layers: [setattr(layer.mlp, "act_fn", nn.GELU("tanh" if index == 1 else "none"))
                     for index, layer in enumerate(layers)], 1,
     "layers 0-1 compute differently from each other, which one trace cannot stand for (the "
     "settings that differ between layers 0-3: mlp.act_fn.approximate)"),
    # A number of the layer's arithmetic changed on layer 1 (its norm's epsilon,
    # added to the variance): a per-layer operand of one scan.
    (lambda layers: setattr(layers[1].post_attention_layernorm, "variance_epsilon", 1e-3), 1,
     None),
    # A submodule of another type on the last layer: layers 0-2 are one scan.
    (lambda layers: setattr(layers[3].mlp, "act_fn", nn.GELU()), 1, None),
    # The same on layers 0 and 2 of 4: a pattern of two layers, one scan over two groups.
    (lambda layers: [setattr(layers[index].mlp, "act_fn", nn.GELU()) for index in (0, 2)], 1,
     None),
], ids=["setting", "number", "submodule", "alternating"])
def test_layers_that_differ_run_as_runs_of_alike_layers(device, change, scans, warned):
    reference = make_model()
    change(reference.model.layers)
    model = stack_layers(copy.deepcopy(reference))
    reference.to(device)
    model.to(device)
    ids, mask = batch(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert forward_while_loops(model, ids) == scans
        close(model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits,
              TRAINING)
    messages = [str(each.message) for each in caught if each.category is LayerByLayerWarning]
    assert all(warned in message for message in messages) and len(messages) == (
        2 if warned else 0), messages  # one warning per call


def test_layers_that_cannot_be_stacked_are_refused_and_the_model_is_unchanged():
    # A parameter shared between two layers: a stack would give each its own slice.
    llama = make_model()
    llama.model.layers[2].mlp.up_proj.weight = llama.model.layers[1].mlp.up_proj.weight
    before = {k: v.clone() for k, v in llama.state_dict().items()}
    with pytest.raises(ValueError, match=r"Layer 2 parameter 'mlp\.up_proj\.weight' is the same "
                                         r"tensor as layer 1's"):
        stack_layers(llama)
    assert type(llama.model.layers) is nn.ModuleList
    assert all(torch.equal(v, before[k]) for k, v in llama.state_dict().items())


def test_a_hook_made_before_converting_runs_and_its_handle_removes_it(device):
    reference, model = make_model().to(device), make_model()
    seen = {"reference": [], "converted": []}
    handles = [each.model.layers[2].self_attn.register_forward_hook(
        lambda module, args, output, name=name: seen[name].append(output[0]))
        for name, each in (("reference", reference), ("converted", model))]
    stack_layers(model).to(device)
    ids, _ = batch(device)
    close(model(ids).logits, reference(ids).logits, TRAINING)
    assert len(seen["converted"]) == 1
    close(seen["converted"], seen["reference"][:1], TRAINING)
    assert model.model.layers.hooked_layers() == (2,)
    handles[1].remove()
    assert model.model.layers.hooked_layers() == ()
    model(ids)
    assert len(seen["converted"]) == 1
    # transformers' own output-capturing hooks, installed by a call that asked for hidden
    # states, set no layer apart: the converted model replays them after its scan.
    model = make_model()
    model(batch("cpu")[0], output_hidden_states=True)
    assert stack_layers(model) is model and type(model.model.layers) is StackedLayers
    assert model.model.layers.hooked_layers() == ()
    # (Gradient checkpointing on the layers is taken over: test_hf_gradient_checkpointing.py.)


@pytest.mark.parametrize("flags", [dict(output_hidden_states=True),
                                   dict(output_attentions=True)], ids=["hidden", "attentions"])
def test_per_layer_outputs_a_model_collects_in_its_own_loop_come_from_its_scan(device, flags):
    # Bloom collects each layer's hidden state and attention weights in its own
    # loop (no hooks): the scan stacks what the loop keeps of every layer.
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=3, n_head=4,
                                      use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    reference = transformers.BloomForCausalLM(config)
    model = stack_layers(copy.deepcopy(reference)).to(device)
    reference.to(device)
    ids, mask = batch(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayerByLayerWarning)
        output = model(ids, attention_mask=mask, **flags)
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([output.logits])
    expected = reference(ids, attention_mask=mask, **flags)
    assert hlo.count(" while(") == 1
    name = "hidden_states" if "output_hidden_states" in flags else "attentions"
    assert len(getattr(output, name)) == len(getattr(expected, name))
    close(getattr(output, name), getattr(expected, name), TRAINING)


def test_the_layer_list_is_found_or_named():
    model = make_model()
    assert stack_layers(model, path="model.layers") is model
    assert type(model.model.layers) is StackedLayers
    stacked = model.model.layers
    assert stack_layers(model) is model and model.model.layers is stacked  # converted already

    base = make_model().model  # a LlamaModel: its layers are `layers`
    stack_layers(base)
    assert type(base.layers) is StackedLayers

    with pytest.raises(ValueError, match="has no submodule 'model.blocks'"):
        stack_layers(make_model(), path="model.blocks")
    with pytest.raises(TypeError, match="'model.norm' is a LlamaRMSNorm, not the nn.ModuleList"
                       ):
        stack_layers(make_model(), path="model.norm")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(4), nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(self.norm(x))


class WorksBetweenLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            x = x * 2
        return x


def test_a_forward_that_works_between_layers_runs_them_one_by_one_naming_the_line(device):
    model = WorksBetweenLayers()
    reference = copy.deepcopy(model).to(device)
    stack_layers(model).to(device)
    x = torch.randn(2, 4, device=device)
    with pytest.warns(LayerByLayerWarning, match=r"The 3 layers ran one by one.*works on what "
                                                 r"layer 0 returned before layer 1 gets it "
                                                 r"\(.*test_hf\.py:\d+: `x = x \* 2`\)"):
        close(model(x), reference(x), TRAINING)


class LooksUpBetweenLayers(WorksBetweenLayers):
    def forward(self, x):
        for index, block in enumerate(self.blocks):
            name = self.names[index]  # calls nothing: the loop still only calls the layers
            x = block(x)
            if self.doubles[0]:  # no plain setting: the call's plan cannot see it change
                x = x * 2
        return x


def test_lookups_between_layers_keep_one_scan_and_a_changed_hidden_state_is_refused(device):
    model = LooksUpBetweenLayers()
    model.names, model.doubles = ["first", "second", "third"], [False]
    reference = copy.deepcopy(model).to(device)
    stack_layers(model).to(device)
    x = torch.randn(2, 4, device=device)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([model(x)])
    assert hlo.count(" while(") == 1
    close(model(x), reference(x), TRAINING)
    # The plan of this kind of call runs the layers as one scan, and each call
    # checks that it gets what the one before returned: work on the hidden
    # state that the plan did not foresee raises rather than go missing.
    model.doubles[0] = True
    with pytest.raises(RuntimeError, match="layer 1 got another hidden state than layer 0 "
                                           "returned"):
        model(x)


class CallsEachLayerByName(WorksBetweenLayers):
    def forward(self, x):
        for name in ("0", "1", "2"):
            x = self.blocks.get_submodule(name)(x)
        return x


def test_layers_reached_by_name_run_as_modules(device):
    # get_submodule("1") gives the layer as a module (of views of its slices),
    # which runs by itself, not through the loop's plan.
    model = CallsEachLayerByName()
    reference = copy.deepcopy(model).to(device)
    stack_layers(model).to(device)
    x = torch.randn(2, 4, device=device)
    assert type(model.blocks.get_submodule("1")) is Block
    close(model(x), reference(x), TRAINING)


def test_only_the_owners_forward_calls_the_layers_through_its_plan(device):
    model = LooksUpBetweenLayers()
    model.names, model.doubles = ["first", "second", "third"], [False]
    stack_layers(model).to(device)
    # Its hooks tell the stack that the forward runs; elsewhere iteration gives modules.
    assert all(type(layer) is Block for layer in model.blocks)
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5, device=device))  # raises inside the loop
    # The hook that marks the forward's end ran all the same.
    assert all(type(layer) is Block for layer in model.blocks)
    hooks = (model._forward_pre_hooks, model._forward_hooks)
    assert all(len(each) == 1 for each in hooks)
    unstack_layers(model)
    assert not any(hooks) and type(model.blocks) is nn.ModuleList


def test_config_changes_reach_the_layers():
    model = stack_layers(make_model())
    model.config._attn_implementation = "eager"
    assert model.model.layers[1].self_attn.config._attn_implementation == "eager"


# ---------------------------------------------------------------------------
# SPMD

def fsdp_training_step_scenario():
    """An AdamW step of the unconverted Llama and of the converted one, its
    stacked weights sharded FSDP style."""
    import numpy as np
    import torch_xla.runtime as xr
    import torch_xla.distributed.spmd as xs

    xr.use_spmd()
    mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), (4,), ("fsdp",))
    device = torch_xla.device()
    reference, model = converted_pair(layers=4)  # test_hf's small Llama, unconverted and converted
    reference.to(device).train()
    model.to(device).train()
    for param in model.model.layers.parameters():
        # FSDP style: each layer's weight split along its first dimension, as
        # a user shards an unconverted layer's: the stacked weight is sharded.
        xs.mark_sharding(param, mesh, ("fsdp",) + (None,) * (param.dim() - 1))
    ids = torch.randint(0, 128, (2, 8)).to(device)
    results = []
    for which in (reference, model):
        optimizer = torch.optim.AdamW(which.parameters(), lr=1e-2)
        loss = which(ids, labels=ids).loss
        loss.backward()
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss, *step_gradients(which)])
        optimizer.step()
        torch_xla.sync()
        results.append((loss.cpu(), {k: v.cpu() for k, v in which.state_dict().items()}, hlo))
    (reference_loss, reference_state, _), (loss, state, hlo) = results
    assert "while" in hlo, "no while loop in the sharded step"
    assert "sharding={devices=[1,4,1]" in hlo, "the stacked weights are not sharded in the step"
    assert "devices=[1,4,1]" in torch_xla._XLAC._get_xla_sharding_spec(
        model.model.layers.segments[0].storage.stacked["self_attn.q_proj.weight"])
    close(loss, reference_loss, TRAINING)
    assert list(state) == list(reference_state)
    close(state, reference_state, TRAINING)
    print("matched")


@supports("sharded", "llama")
def test_fsdp_sharded_stacked_weights_train_like_the_unsharded_model(run_isolated):
    result = run_isolated(fsdp_training_step_scenario, env={"CPU_NUM_DEVICES": "4"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "matched" in result.stdout


# transformers' Trainer, as a fine-tuning script runs it: on the XLA device
# (through accelerate), AdamW (`adamw_torch`: the fused default takes no XLA
# tensors), a loss logged every step; a full fine-tune, then LoRA adapters.
def trainer_run_scenario():
    """transformers' Trainer trains each model of a pair; the losses it logs agree."""
    import tempfile
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False))
    lora = get_peft_model(copy.deepcopy(model),
                          LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    pairs = {"full": (model, stack_layers(copy.deepcopy(model))),
             "lora": (lora, stack_layers(copy.deepcopy(lora)))}
    ids = torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in ids]

    def logged_losses(model):
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(
                out, per_device_train_batch_size=2, max_steps=4, logging_steps=1,
                optim="adamw_torch", learning_rate=1e-2, report_to=[], save_strategy="no", seed=3,
                disable_tqdm=True)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
            trainer.train()
        assert next(model.parameters()).device.type == "xla"
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    for name, (reference, converted) in pairs.items():
        expected = logged_losses(reference)
        with warnings.catch_warnings():
            warnings.simplefilter("error", LayerByLayerWarning)
            losses = logged_losses(converted)
        assert len(expected) == 4, expected
        close(torch.tensor(losses), torch.tensor(expected), LOGGED_LOSSES)
        print(name, "losses", losses)


@supports("LoRA", "llama")
def test_trainer_logs_the_unconverted_models_losses_full_and_lora(run_isolated):
    result = run_isolated(trainer_run_scenario)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "full losses" in result.stdout and "lora losses" in result.stdout
