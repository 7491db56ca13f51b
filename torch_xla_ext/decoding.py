"""`generate`: decoding with one compiled prefill graph and one compiled decode
step, whatever the number of new tokens.

transformers' `generate()` on XLA compiles a new graph for nearly every token:
its attention mask and its inputs grow by one column per step, and its steps
are never cut into graphs of one shape. Here every tensor a decode step reads
has the same shape at every step (the attention mask spans the whole cache; the
positions and the cache's length are device tensors), and each step ends with
a sync, so all the steps after the prefill run one compiled graph.

    tokens = generate(model, input_ids, max_new_tokens)

is, for tokens and random draws, `model.generate(input_ids, max_new_tokens=...,
cache_implementation="static")` with greedy or sampling settings taken from the
arguments, else from `model.generation_config`.
"""
from __future__ import annotations

import inspect

import torch
import torch_xla
import torch_xla.core.xla_model as xm

__all__ = ["generate"]

# transformers' defaults for settings a generation config leaves unset.
_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *,
             attention_mask: torch.Tensor | None = None, do_sample: bool | None = None,
             temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None, max_cache_len: int | None = None) -> torch.Tensor:
    """Generates up to `max_new_tokens` tokens after each row of `input_ids`
    ([batch, prompt] on the XLA device, left-padded where `attention_mask` has
    zeros) with a transformers causal LM, converted by `stack_layers` or not.

    Returns `[batch, prompt + n]` token ids, as `model.generate()` does: the
    prompt, then the new tokens, `pad_token_id` after a row's end-of-sequence
    token; n is `max_new_tokens`, or fewer when every row has ended.

    Greedy by default; `do_sample=True` samples from the logits scaled by
    `temperature` and cut to the `top_k` most likely tokens and to the
    smallest set whose probability reaches `top_p` (transformers' order and
    defaults: unset values come from `model.generation_config`, else 1.0, 50,
    1.0). Sampling draws the random numbers `model.generate()` would draw from
    the XLA RNG, so under the same seed both give the same tokens.

    The keys and values live in a transformers `StaticCache` of
    `max_cache_len` positions (default: prompt + `max_new_tokens`); with a
    converted model, its stacked buffers, which every step's scan writes in
    place. A call compiles the prefill graph, one decode step graph, and a few
    small graphs around them; another call with the same batch, prompt length
    and `max_cache_len` compiles nothing, whatever its `max_new_tokens` (set
    `max_cache_len` to share them between calls)."""
    from transformers import StaticCache  # transformers only where it is used

    batch, prompt = _check_input_ids(input_ids)
    max_new_tokens = _check_positive_int(max_new_tokens, "max_new_tokens")
    max_cache_len = (prompt + max_new_tokens if max_cache_len is None
                     else _check_positive_int(max_cache_len, "max_cache_len"))
    if prompt + max_new_tokens > max_cache_len:
        raise ValueError(
            f"generate: the prompt ({prompt} tokens) and max_new_tokens={max_new_tokens} need "
            f"{prompt + max_new_tokens} cache positions, more than max_cache_len={max_cache_len}; "
            f"raise max_cache_len or lower max_new_tokens")
    choose = _TokenChoice(model, do_sample, temperature, top_k, top_p)
    device = input_ids.device
    # What the caller left pending (a prompt made on the device, say) runs as
    # a graph of its own, before this call makes any tensor: inside the
    # prefill's graph it would make that graph differ between a first call and
    # the later ones, which would compile it again.
    _sync(device, keep_draws=choose.do_sample)
    attention_mask = _check_attention_mask(attention_mask, input_ids)
    stop = _Stop(model, eos_token_id, pad_token_id, batch, device)

    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    # The mask over every cache position: the prompt's, then ones up to the
    # token being fed. One shape for every step.
    cache_positions = torch.arange(max_cache_len, device=device)
    prompt_mask = torch.nn.functional.pad(attention_mask, (0, max_cache_len - prompt))
    positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    # The prompt and the tokens chosen so far, at their cache positions: each
    # step writes its token into it, in its one graph.
    sequences = torch.nn.functional.pad(input_ids, (0, max_cache_len - prompt))
    with torch.no_grad():
        logits = _last_logits(model, input_ids, attention_mask, positions, cache)
        # The position and cache position of the token fed last. Copies, not
        # views: the prefill's sync then makes them device data, as the later
        # steps' are, and the first step runs their graph too.
        position, fed = positions[:, -1:].clone(), cache_positions[prompt - 1].clone()
        for chosen in range(1, max_new_tokens + 1):
            token = stop.apply(choose(logits))
            sequences.index_copy_(1, (fed + 1).reshape(1), token[:, None].to(sequences.dtype))
            _sync(device, keep_draws=choose.do_sample)
            if chosen == max_new_tokens or stop.all_ended():
                break
            position, fed = position + 1, fed + 1
            mask = torch.where(cache_positions < prompt, prompt_mask,
                               (cache_positions <= fed).to(prompt_mask.dtype))
            logits = _last_logits(model, token[:, None], mask, position, cache)
    # Cut on the host: a slice on the device would compile a graph per length.
    return sequences.cpu()[:, :prompt + chosen].to(input_ids.device)


def _last_logits(model, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
    # As generate(): the logits of the last position only, where the model can.
    only_last = ({"logits_to_keep": 1}
                 if "logits_to_keep" in inspect.signature(model.forward).parameters else {})
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   past_key_values=cache, use_cache=True, **only_last).logits
    return logits[:, -1].to(torch.float32)


class _TokenChoice:
    """The next token from the last logits: argmax, or a draw after
    temperature, top-k and top-p, as transformers' logits warpers do them."""

    def __init__(self, model, do_sample, temperature, top_k, top_p):
        config = getattr(model, "generation_config", None)

        def setting(name, given):
            if given is not None:
                return given
            value = getattr(config, name, None)
            return _DEFAULTS[name] if value is None else value

        self.do_sample = bool(setting("do_sample", do_sample))
        self.temperature = float(setting("temperature", temperature))
        self.top_k = int(setting("top_k", top_k))
        self.top_p = float(setting("top_p", top_p))
        if self.do_sample:
            if not self.temperature > 0:
                raise ValueError(f"generate: temperature must be > 0 to sample, got "
                                 f"{self.temperature}")
            if self.top_k < 0:
                raise ValueError(f"generate: top_k must be >= 0 (0: no cut), got {self.top_k}")
            if not 0 < self.top_p <= 1:
                raise ValueError(f"generate: top_p must be in (0, 1], got {self.top_p}")

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.do_sample:
            return logits.argmax(dim=-1)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        if self.top_k:
            kth_largest = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth_largest, float("-inf"))
        if self.top_p < 1.0:
            ascending, order = logits.sort(dim=-1)
            # Drop the least likely tokens while what they leave still reaches
            # top_p; the most likely one always stays.
            dropped = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - self.top_p
            dropped[:, -1] = False
            logits = logits.masked_fill(dropped.scatter(1, order, dropped), float("-inf"))
        return torch.multinomial(logits.softmax(dim=-1), num_samples=1)[:, 0]


def _sync(device, keep_draws: bool) -> None:
    """Cuts the graph of what is pending (before the prefill, then the
    prefill's, then the one every decoding step runs). transformers never
    syncs, so its draws follow one seed sequence; a sync starts a new one, so
    with `keep_draws` the state before the sync is put back after it, and the
    next draw is the one that would have followed."""
    state = xm.get_rng_state(device) if keep_draws else None
    torch_xla.sync()
    if state is not None:
        xm.set_rng_state(state, device)


class _Stop:
    """End-of-sequence handling: after a row's end token, it gets padding."""

    def __init__(self, model, eos_token_id, pad_token_id, batch, device):
        config = getattr(model, "generation_config", None)
        if eos_token_id is None:
            eos_token_id = getattr(config, "eos_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(config, "pad_token_id", None)
        eos = ([] if eos_token_id is None else
               [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        if not all(isinstance(token, int) and not isinstance(token, bool) for token in eos):
            raise TypeError(f"generate: eos_token_id must be an int or a list of ints, got "
                            f"{eos_token_id!r}")
        if eos and pad_token_id is None:
            pad_token_id = eos[0]  # as transformers does, with a warning
        self.eos = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
        self.pad_token_id = pad_token_id
        self.unfinished = torch.ones(batch, dtype=torch.long, device=device)

    def apply(self, token: torch.Tensor) -> torch.Tensor:
        if self.eos is None:
            return token
        token = token * self.unfinished + self.pad_token_id * (1 - self.unfinished)
        self.unfinished = self.unfinished & (token[:, None] != self.eos).all(dim=-1).long()
        return token

    def all_ended(self) -> bool:
        # One small graph, read back once per step when there is an end token.
        return self.eos is not None and not bool(self.unfinished.any())


def _check_input_ids(input_ids) -> tuple[int, int]:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"generate: input_ids must be a tensor of token ids, got "
                        f"{type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"generate: input_ids must be [batch, prompt] integer token ids, got "
                         f"{input_ids.dtype} {tuple(input_ids.shape)}")
    if input_ids.device.type != "xla":
        raise ValueError(f"generate: input_ids is on {input_ids.device}; move it to the XLA "
                         f"device (input_ids.to(torch_xla.device())), where the model runs")
    if input_ids.shape[1] == 0:
        raise ValueError("generate: input_ids has an empty prompt; give at least one token")
    return input_ids.shape[0], input_ids.shape[1]


def _check_positive_int(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"generate: {name} must be a positive int, got {value!r}")
    return value


def _check_attention_mask(attention_mask, input_ids: torch.Tensor) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.long)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"generate: attention_mask must be a tensor shaped as input_ids "
            f"{tuple(input_ids.shape)}, got "
            f"{tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask!r}")
    return attention_mask.to(device=input_ids.device, dtype=torch.long)
