"""Key/value caches that keep per-layer state besides their `layers` (a list
their methods read and write at the layer index they are given: MiniMax's
`linear_cache`), starting empty: one scan stands for the layers, each step
filling a one-layer cache of the cache's own class, and the cache after the
call holds what the unconverted model's does (`hf/fresh_caches`); and cache
layers that hold settings as 0-d tensors before any token (DeepSeek-V4's)."""
import copy
import warnings

import pytest
import torch
import torch_xla
import transformers
from torch import nn
from torch.utils._pytree import tree_flatten_with_path

from per_layer import per_layer_grads
from reference import host_copies
from test_hf import batch, left_padded_prompts, seeded_generate
from tolerances import TRAINING, close, close_by_name
from torch_xla_ext.hf import stack_layers
from torch_xla_ext.layer_stack import LayerByLayerWarning

HIDDEN, VOCAB, LAYERS = 16, 128, 4


class SummaryCache(transformers.DynamicCache):
    """A cache subclass with a per-layer side list, which its methods read and
    write by the layer's index, padding the slots of layers that write none."""

    def __init__(self):
        super().__init__()
        self.summaries = []

    def get_summary(self, layer_idx):
        return self.summaries[layer_idx] if layer_idx < len(self.summaries) else None

    def set_summary(self, layer_idx, summary):
        self.summaries += ["none"] * (layer_idx + 1 - len(self.summaries))
        self.summaries[layer_idx] = summary


class SummaryDictCache(transformers.DynamicCache):
    """The same with a dict keyed by layer index."""

    def __init__(self):
        super().__init__()
        self.summaries = {}

    def get_summary(self, layer_idx):
        return self.summaries.get(layer_idx)

    def set_summary(self, layer_idx, summary):
        self.summaries[layer_idx] = summary


class CountingCache(SummaryCache):
    """One whose method also keeps a count of its own, not per layer."""

    def __init__(self):
        super().__init__()
        self.writes = 0

    def set_summary(self, layer_idx, summary):
        super().set_summary(layer_idx, summary)
        self.writes += 1


class SummaryBlock(nn.Module):
    """A layer that keeps a running summary of its input in the cache's side
    list and its projections as the cache's keys and values."""

    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.gate = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden, cache=None):
        projected = self.proj(hidden)
        previous = cache.get_summary(self.layer_idx)
        summary = projected.mean(1) if previous is None else previous + projected.mean(1)
        cache.set_summary(self.layer_idx, summary)
        keys, _ = cache.update(projected[:, None], projected[:, None], self.layer_idx)
        return hidden + torch.tanh(self.gate(hidden)) * summary[:, None] + keys[:, 0]


class SummaryModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(SummaryBlock(index) for index in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, cache):
        hidden = self.embed(ids)
        for layer in self.layers:
            hidden = layer(hidden, cache=cache)
        return self.head(hidden)


@pytest.mark.parametrize("cache_class", [SummaryCache, SummaryDictCache], ids=["list", "dict"])
def test_a_cache_with_a_side_list_trains_as_one_scan_and_is_left_as_unconverted(device,
                                                                                  cache_class):
    torch.manual_seed(0)
    reference = SummaryModel()
    model = stack_layers(copy.deepcopy(reference))
    ids, _ = batch(device)
    results = []
    for which in (reference, model):
        which.to(device)
        cache = cache_class()
        with warnings.catch_warnings():
            warnings.simplefilter("error", LayerByLayerWarning)
            loss = nn.functional.cross_entropy(which(ids, cache).flatten(0, 1), ids.flatten())
        loss.backward()
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss])
        grads = per_layer_grads(which)
        assert len(cache.summaries) == len(cache.layers) == LAYERS
        summaries = (cache.summaries if isinstance(cache.summaries, dict)
                     else dict(enumerate(cache.summaries)))
        held = {**{f"summary {index}": summary for index, summary in summaries.items()},
                **{f"{name} {index}": getattr(layer, name) for index, layer in
                   enumerate(cache.layers) for name in ("keys", "values")}}
        values = {"loss": loss, **grads, **held}
        results.append((hlo, dict(zip(values, host_copies(list(values.values()))))))
    (reference_hlo, expected), (hlo, actual) = results
    assert "while" in hlo and "while" not in reference_hlo
    close_by_name(actual, expected, TRAINING)


def test_a_layer_changing_other_state_of_the_cache_raises_rather_than_lose_it(device):
    torch.manual_seed(0)
    model = stack_layers(SummaryModel()).to(device)
    ids, _ = batch(device)
    with pytest.raises(ValueError, match=r"changed the key/value cache's attributes \['writes'\]"):
        model(ids, CountingCache())


def minimax_pair(**config):
    """An unconverted MiniMax (full and linear attention alternating: one scan
    over groups of the two) and a converted copy with the same weights."""
    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    num_local_experts=4, num_experts_per_tok=2, block_size=4,
                    layer_types=["full_attention", "linear_attention"] * 2)
    torch.manual_seed(0)
    reference = transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(**{**settings,
                                                                              **config}))
    reference.set_experts_implementation("batched_mm")
    return reference, stack_layers(copy.deepcopy(reference))


def cache_tensors(cache) -> dict:
    """What a MiniMax cache holds: its linear layers' matrices (the other
    slots padded with []), its attention layers' keys and values."""
    assert all(isinstance(slot, torch.Tensor) or slot == [] for slot in cache.linear_cache)
    return {**{f"linear {index}": slot for index, slot in enumerate(cache.linear_cache)
               if isinstance(slot, torch.Tensor)},
            **{f"{name} {index}": getattr(layer, name) for index, layer in enumerate(cache.layers)
               if layer.is_initialized for name in ("keys", "values")}}


def trained_with_their_caches(reference, model, device, cache_state) -> list[tuple]:
    """A training step of each model with the cache it makes itself
    (`use_cache` True): the graph of its loss, and what `cache_state(cache)`
    gives of its cache beside its tensors (which join the loss and
    gradients, copied to the host)."""
    ids, mask = batch(device)
    results = []
    for which in (reference, model):
        which.to(device).train()
        with warnings.catch_warnings():
            warnings.simplefilter("error", LayerByLayerWarning)
            output = which(ids, attention_mask=mask, labels=ids)
        output.loss.backward()
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([output.loss])
        others, tensors = cache_state(output.past_key_values)
        values = {"loss": output.loss, **per_layer_grads(which), **tensors}
        results.append((hlo, others, dict(zip(values, host_copies(list(values.values()))))))
    return results


def test_minimax_trains_with_its_default_cache_as_one_scan_with_the_unconverted_results(device):
    def layout_and_tensors(cache):  # a MiniMaxCache
        return (([type(slot).__name__ for slot in cache.linear_cache],
                 [layer.is_initialized for layer in cache.layers]), cache_tensors(cache))

    (reference_hlo, expected_layout, expected), (hlo, layout, actual) = \
        trained_with_their_caches(*minimax_pair(), device, layout_and_tensors)
    assert "while" in hlo and "while" not in reference_hlo
    assert layout == expected_layout == (["list", "Tensor"] * 2, [True, False, True])
    close_by_name(actual, expected, TRAINING)


def test_minimax_generates_the_unconverted_tokens_from_a_scanned_prefill(device):
    reference, model = minimax_pair(use_cache=True)
    ids, mask = left_padded_prompts((0, 2), device)
    tokens = []
    for which in (reference, model):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tokens.append(seeded_generate(which, ids, mask, do_sample=False))
    assert tokens[1] == tokens[0]
    # The prefill is a scan; the decoding step reads what it left, its layers
    # one by one (a cache holding state besides its layers' keys and values).
    reasons = [str(w.message) for w in caught if w.category is LayerByLayerWarning]
    assert len(reasons) == 1 and "of a kind, or in a state" in reasons[0]


def test_cache_layers_holding_a_window_size_tensor_train_as_one_scan(device):
    # DeepSeek-V4's cache layers (made up front from the config) hold their
    # sliding window's size as a 0-d tensor before they hold any token.
    settings = dict(vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, qk_rope_head_dim=16, q_lora_rank=16, o_lora_rank=16,
                    num_experts_per_tok=2, n_routed_experts=4, sliding_window=4,
                    index_n_heads=4, index_head_dim=16, index_topk=2,
                    layer_types=["heavily_compressed_attention"] * 2, mlp_layer_types=["moe"] * 2)
    torch.manual_seed(0)
    reference = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**settings))
    reference.set_experts_implementation("batched_mm")
    model = stack_layers(copy.deepcopy(reference))

    def held_apart(cache):  # a DynamicCache
        held = {f"{index} {path}": leaf for index, layer in enumerate(cache.layers)
                for path, leaf in tree_flatten_with_path(vars(layer))[0]}
        tensors = {name: leaf for name, leaf in held.items() if isinstance(leaf, torch.Tensor)}
        return {name: leaf for name, leaf in held.items() if name not in tensors}, tensors

    (reference_hlo, expected_others, expected), (hlo, others, actual) = \
        trained_with_their_caches(reference, model, device, held_apart)
    assert "while" in hlo and "while" not in reference_hlo
    assert others == expected_others
    # The compressors get no gradient at 8 tokens (their windows are longer):
    # none unconverted, zeros in the stacked parameters' gradients.
    unused = actual.keys() - expected.keys()
    assert expected.keys() <= actual.keys() and unused and all(
        ".compressor." in name and not actual[name].any() for name in unused)
    for name, value in expected.items():
        close(actual[name], value, TRAINING)
