"""Small configs of every causal-LM type of transformers, shrunk generically
from each type's own default config (scripts/sweep_causal_lm.py builds them).

`small_config(model_type, layers)` reads `AutoConfig.for_model(model_type)`
and rebuilds it with every size-like attribute made small, by what its name
says it is (the first rule of SIZE_RULES whose pattern matches), in the
config and in each of its sub-configs (`text_config`, `vision_config`, ...):

* layer counts become `layers`; counts of layers with a role (dense layers
  first, layers sharing a cache, ...) and periods of a layer pattern (a full
  attention every n-th layer, ...) at most half of them;
* the hidden size becomes HIDDEN and the widths that go with it (intermediate,
  embeddings, ...) keep their ratio to it; heads become HEADS of HEAD_DIM
  (key/value heads as many, or KV_HEADS where there were fewer); ranks,
  states, windows, chunks and experts get small caps;
* lists with one entry per layer (`layer_types`, `mlp_layer_types`, ...) and
  dicts keyed by layer (`per_layer_config`) keep the layers `kept_layers`
  chooses: the first ones, but the first layer of each kind the whole model
  has among them, so that the few layers show every kind; lists of layer
  indices follow the layers kept. A per-layer list shorter than `layers`
  (a default config of one layer of each kind, Nemotron-H's) repeats to
  `layers` entries, as real checkpoints repeat a pattern, so that its kinds
  come in groups a scan can run; a config that derives its layer count from
  such a list (a property, not a setting) counts its layers by the list;
* special token ids at or above the inputs' range move to the top of the
  smaller vocabulary (`input_id_limit`);
* dropout (and routers' jitter) off, and encoder families' configs decoders
  (`is_decoder`), as their causal-LM classes expect.

A few types need more than that: TWEAKS, each entry with its reason.
Importing this module imports neither torch nor transformers.
"""
from __future__ import annotations

import re
from typing import Any, Callable

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
# The training inputs' sequence length; windows and chunks are shorter.
SEQUENCE = 16
WINDOW = SEQUENCE // 2
VOCAB = 256
# A vocabulary at most this large stays as it is (byte-level models).
SMALL_VOCAB = 512
# Special token ids take the top of the vocabulary; inputs are drawn below.
SPECIAL_IDS = 32
SMALL_SIZE = 16
EXPERTS = 4


def _layer_count(value: int, layers: int, _: dict) -> int:
    return layers


def _some_layers(value: int, layers: int, _: dict) -> int:
    """A count of layers with a role, or a pattern's period: at most half."""
    return min(value, max(1, layers // 2))


def _with_hidden(value: int, _: int, context: dict) -> int:
    """A width that goes with the hidden size: its ratio to it, in multiples of 8."""
    scaled = value * HIDDEN / context["hidden"] if context["hidden"] else value
    return max(8, 8 * round(scaled / 8))


def _capped(cap: int) -> Callable[[int, int, dict], int]:
    return lambda value, _, __: min(value, cap)


def _fixed(size: int) -> Callable[[int, int, dict], int]:
    return lambda value, _, __: size


def _kv_heads(value: int, _: int, context: dict) -> int:
    return HEADS if value >= context["heads"] else KV_HEADS


def _vocab(value: int, _: int, __: dict) -> int:
    return value if value <= SMALL_VOCAB else VOCAB


# (pattern on the attribute's name, new value from (value, layers, context)),
# the first match decides; an int attribute no pattern matches stays.
SIZE_RULES: list[tuple[str, Callable[[int, int, dict], int]]] = [
    (r"^(num_)?(hidden_|decoder_|encoder_)?layers$|^n_layers?$|^num_(encoder|decoder)_layers$"
     r"|^num_blocks$", _layer_count),
    (r"period|pattern|every_n|interval|group_size|per_stack|per_attn_res_block|first_k_dense"
     r"|dense_layers|shared_layers|window_layers|layer_end_index", _some_layers),
    (r"_offset$", lambda value, layers, _: min(value, max(0, layers // 2 - 1))),
    (r"key_value_heads|kv_heads|num_query_groups", _kv_heads),
    (r"attention_heads$|^n_heads?$|^num_heads$|^attention_heads$", _fixed(HEADS)),
    # A Mamba2 mixer's heads times their size is its inner width, twice the hidden size.
    (r"mamba.*heads", _fixed(2 * HIDDEN // HEAD_DIM)),
    (r"d_ssm$", _fixed(2 * HIDDEN)),
    (r"heads", _capped(HEADS)),
    (r"^qk_head_dim$", _fixed(2 * HEAD_DIM)),  # a rotary part and the rest (DeepSeek's)
    # Rotary parts of a head too: DeepSeek's head_dim is its rotary part.
    (r"head_dim|head_size|d_head|dim_head|kv_channels|headdim|^d_kv$|rotary_dim|rope_dim",
     _fixed(HEAD_DIM)),
    (r"vocab_size$", _vocab),
    (r"rank$", _capped(SMALL_SIZE)),
    (r"state_size|d_state$", _capped(SMALL_SIZE)),
    (r"window|local_attention$", _capped(WINDOW)),
    (r"chunk_?size|chunk_length", _capped(SEQUENCE)),
    (r"per_tok|experts_per_token|^moe_k$|topk$|^top_k$", _capped(EXPERTS // 2)),
    (r"shared_experts$|topk_group", _capped(1)),
    (r"experts$|expert_num$", _capped(EXPERTS)),
    # Groups of experts (DeepSeek's routing picks groups, then experts within them).
    (r"^n_group$|expert_group$", _capped(2)),
    (r"index_topk", _capped(WINDOW)),
    (r"^hidden_size$|^d_model$|^n_embd$|^emb_dim$|^embedding_dim$", _fixed(HIDDEN)),
    # A multimodal adapter takes its tower's width to the text model's (HIDDEN too).
    (r"adapter_(in|input)_", _with_hidden),
    (r"adapter_(out|output)_", _fixed(HIDDEN)),
    (r"intermediate|ffn|^d_ff$|dim_ff|^d_inner$|^n_inner$|^dff$|feed_forward_size|hidden_size"
     r"|embedding_size|embed_dim|proj_dim|width$", _with_hidden),
]
# Special token ids: moved within the smaller vocabulary (see `_special_ids`), not sized.
TOKEN_ID = re.compile(r"token_id|token_index|_index$|^(pad|bos|eos|unk|mask|sep|cls)_id$")
HIDDEN_NAMES = ("hidden_size", "d_model", "n_embd", "emb_dim", "embedding_dim")
LAYER_COUNT_NAMES = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")
HEADS_NAMES = ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
               "decoder_attention_heads", "encoder_attention_heads")
# Lists of layer indices (`full_attn_idxs`, `mlp_only_layers`, ...).
INDEX_LIST_NAMES = re.compile(r"idxs|_ids$|indices|_layers$")
DROPOUT = re.compile(r"dropout|_pdrop$|drop_prob|layerdrop|jitter")
# Configs not to touch: labels, and settings of tokenizers and generation.
UNTOUCHED = ("id2label", "label2id", "task_specific_params", "transformers_version")

# Per-type settings the generic shrink cannot know: a type's settings at a
# number of layers, and why it needs them.
TWEAKS: dict[str, tuple[Callable[[int], dict[str, Any]], str]] = {
    "mamba2": (lambda layers: {"num_heads": 2 * HIDDEN // HEAD_DIM},
               "its heads are the mixer's (heads x head_dim = 2 x hidden), under the name "
               "attention heads have elsewhere"),
    "reformer": (lambda layers: {"axial_pos_shape": [4, SEQUENCE // 4],
                                 "axial_pos_embds_dim": [16, HIDDEN - 16]},
                 "axial position embeddings: the shape's product is the training sequence's "
                 "length, the widths sum to the hidden size"),
    "xmod": (lambda layers: {"default_language": "en_XX"},
             "its adapters need a language; en_XX is its config's one"),
    "zamba": (lambda layers: {"layers_block_type": ["linear_attention", "hybrid"] * (layers // 2)},
              "its shared transformer block is tied across hybrid layers, which fails to "
              "build with a single one"),
    "hrm_text": (lambda layers: {"num_layers_per_stack": layers // 2,
                                 "num_hidden_layers": layers // 2 * 2 * 4},
                 "num_hidden_layers counts layer calls: layers per stack x H_cycles (2) x "
                 "(L_cycles + 1) (4)"),
    "dots3_note_text": (lambda layers: {"head_dim": 2 * HEAD_DIM},
                        "its sliding-window layers' head_dim must be qk_nope_head_dim + "
                        "qk_rope_head_dim"),
    "dots3_note": (lambda layers: {"text_config": {"head_dim": 2 * HEAD_DIM}},
                   "as dots3_note_text, its text config"),
    "big_bird": (lambda layers: {"attention_type": "original_full"},
                 "at the sweep's short sequences its forward switches every layer to full "
                 "attention by replacing the layer's attention module, a change a stack's "
                 "per-layer views do not keep (docs/limits.md); full attention from the start"),
    "deepseek_v2": (lambda layers: {"num_experts_per_tok": EXPERTS // 2},
                    "its default leaves num_experts_per_tok None, which its router reads"),
    "dots1": (lambda layers: {"n_routed_experts": EXPERTS, "num_experts_per_tok": EXPERTS // 2,
                              "n_shared_experts": 1},
              "its default leaves the numbers of experts None, which its experts read"),
    "lfm2_moe": (lambda layers: {"layer_types": ["full_attention" if index % 3 == 2 else "conv"
                                                 for index in range(layers)]},
                 "its default leaves layer_types None, which its layers read (LFM2's pattern: "
                 "every third layer attends)"),
    "gemma3n_text": (lambda layers: {"layer_types": ["sliding_attention", "full_attention"]
                                     * (layers // 2), "num_kv_shared_layers": layers // 2},
                     "the last num_kv_shared_layers layers reuse the caches of earlier layers "
                     "of their kind, so each kind must come before them"),
}


def rule_for(name: str) -> Callable[[int, int, dict], int] | None:
    """The first rule of SIZE_RULES whose pattern matches `name`, or None."""
    for pattern, rule in SIZE_RULES:
        if re.search(pattern, name):
            return rule
    return None


def _first(values: dict, names: tuple[str, ...]) -> int | None:
    return next((values[name] for name in names if _is_int(values.get(name))), None)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layer_key(key) -> int | None:
    """The layer index a per-layer dict's key names ('05', 5), or None."""
    return int(key) if str(key).isdigit() else None


def kept_layers(values: dict, count: int, layers: int) -> list[int]:
    """Which of the `count` layers the small config keeps: the first
    `layers`, but with each kind of layer (what the per-layer lists and a
    per-layer dict say of it) at its first place, so that the few layers
    keep every kind of the whole model (as many kinds as fit). Fewer than
    `layers` repeat, in order, up to `layers`."""
    if layers > count:
        return [index % count for index in range(layers)]
    per_layer = [value for value in values.values()
                 if isinstance(value, list) and len(value) == count]
    overrides = [value for value in values.values() if isinstance(value, dict) and value
                 and all(_layer_key(key) is not None for key in value)]

    def kind(index: int) -> str:
        return repr(([each[index] for each in per_layer],
                     [next((v for k, v in each.items() if _layer_key(k) == index), None)
                      for each in overrides]))

    first_of_kind: dict[str, int] = {}
    for index in range(count):
        first_of_kind.setdefault(kind(index), index)
    chosen = sorted(first_of_kind.values())[:layers]
    rest = [index for index in range(count) if index not in chosen]
    return sorted(chosen + rest[:layers - len(chosen)])


def shrunk_value(name: str, value, layers: int, context: dict, kept: list[int] | None):
    """`value` of setting `name` made small (see the module's docstring)."""
    count = context["count"]
    # Left None by a few defaults, and read by their attention with no fallback.
    if value is None and name == "head_dim" and context["heads"]:
        return HEAD_DIM
    if value is None and name == "num_key_value_heads" and context["heads"]:
        return HEADS
    if _is_int(value) and value > 0 and not TOKEN_ID.search(name):
        rule = rule_for(name)
        return value if rule is None else rule(value, layers, context)
    if isinstance(value, float) and DROPOUT.search(name) and value > 0:
        return 0.0
    if name == "is_decoder" and value is False:
        return True  # the causal-LM classes of encoder families are decoders
    if kept is None or name in UNTOUCHED:
        return value
    if isinstance(value, list) and len(value) == count:
        return [shrunk_value(name, value[index], layers, context, None) for index in kept]
    if (isinstance(value, list) and value and INDEX_LIST_NAMES.search(name)
            and all(_is_int(each) and 0 <= each < count for each in value)):
        return [new for new, old in enumerate(kept) if old in value]
    if isinstance(value, dict) and value and all(_layer_key(key) is not None for key in value):
        width = len(next(iter(value)))
        return {str(new).zfill(width) if isinstance(key, str) else new:
                (_shrunk_override(override, layers, context)
                 if isinstance(override, dict) else override)
                for key, override in value.items() for new in _new_places(_layer_key(key), kept)}
    return value


def _new_places(index: int, kept: list[int]) -> list[int]:
    """Where layer `index` of the default config is in the small one (nowhere,
    once, or at each repetition of a pattern)."""
    return [new for new, old in enumerate(kept) if old == index]


def _shrunk_override(override: dict, layers: int, context: dict) -> dict:
    """A per-layer dict's settings of one layer, shrunk; its own heads, if it
    sets them, are what its key/value heads compare with."""
    context = {**context, "heads": _first(override, HEADS_NAMES) or context["heads"]}
    return {name: shrunk_value(name, value, layers, context, None)
            for name, value in override.items()}


def shrunk_changes(config, layers: int) -> dict:
    """What changes to make `config` small: its settings that change, by name,
    and for each sub-config the same, nested."""
    values = {name: value for name, value in config.to_dict().items()
              if name not in getattr(config, "sub_configs", {})}
    count = _first(values, LAYER_COUNT_NAMES) or _derived_layer_count(config, values)
    context = {"hidden": _first(values, HIDDEN_NAMES), "heads": _first(values, HEADS_NAMES) or 0,
               "count": count}
    kept = kept_layers(values, count, layers) if count and count > 2 else None
    changes = {}
    for name, value in values.items():
        small = shrunk_value(name, value, layers, context, kept)
        if small != value:
            changes[name] = small
    for name in getattr(config, "sub_configs", {}):
        if hasattr(getattr(config, name, None), "to_dict"):
            changes[name] = shrunk_changes(getattr(config, name), layers)
    # A composite config's special ids are of its text config's vocabulary.
    vocabularies = [changes.get("vocab_size", values.get("vocab_size")),
                    *(changes[name].get("vocab_size") for name in sorted(
                        getattr(config, "sub_configs", {}), key=lambda name: "text" not in name)
                      if isinstance(changes.get(name), dict))]
    vocab = next((each for each in vocabularies if _is_int(each)), None)
    if vocab is not None:
        changes.update(_special_ids(values, vocab))
    return changes


def _derived_layer_count(config, values: dict) -> int | None:
    """A layer count the config derives instead of keeping it among its
    settings (Nemotron-H's num_hidden_layers, the length of its
    layers_block_type), where a per-layer list of its settings is that long."""
    count = next((getattr(config, name, None) for name in LAYER_COUNT_NAMES
                  if _is_int(getattr(config, name, None))), None)
    return count if count and any(isinstance(value, list) and len(value) == count
                                  for value in values.values()) else None


def _special_ids(values: dict, vocab: int) -> dict:
    """Special token ids at or above the limit of the inputs' range (an image
    token's, say), moved to the top of the vocabulary, distinct ones kept
    distinct; lower ones (an end of text's) stay."""
    names = [name for name, value in values.items()
             if _is_int(value) and TOKEN_ID.search(name)]
    distinct = sorted({values[name] for name in names})
    moved = {old: vocab - 1 - index for index, old in enumerate(distinct)}
    return {name: moved[values[name]] for name in names
            if values[name] >= input_id_limit(vocab) and moved[values[name]] != values[name]}


def input_id_limit(vocab: int) -> int:
    """Training inputs are drawn from [0, limit): below the special ids."""
    return max(1, vocab - SPECIAL_IDS)


def small_config(model_type: str, layers: int):
    """The small config of `model_type`, and the changes that made it small
    (TWEAKS' included)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    tweaks = TWEAKS[model_type][0](layers) if model_type in TWEAKS else {}
    changes = _merged(shrunk_changes(default, layers), tweaks)
    # A sub-config is passed whole, as a dict: its composite config may have
    # built it with other settings than its class's defaults.
    settings = {name: ({**getattr(default, name).to_dict(), **value}
                       if name in getattr(default, "sub_configs", {}) else value)
                for name, value in changes.items()}
    return AutoConfig.for_model(model_type, **settings), changes


def _merged(changes: dict, tweaks: dict) -> dict:
    merged = dict(changes)
    for name, value in tweaks.items():
        merged[name] = (_merged(merged[name], value) if isinstance(value, dict)
                        and isinstance(merged.get(name), dict) else value)
    return merged
