"""A decoder-block training workload shared by tests, benchmarks and metric comparisons.

`DecoderBlock` is a pre-norm transformer decoder layer named like Hugging Face's
Llama layers (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, ...);
`BLOCKS` also names two layers whose shape we did not choose (a fused-qkv
SDPA block written the common way, and transformers' LlamaDecoderLayer).
`make_decoder_stack` builds a stack of one of them run in one of `MODES`:

* `loop`: an `nn.ModuleList` run by a Python for loop (one graph per layer),
* `scan`: a `LayerStack` (one scan, stacked weights, no weight copy),
* `torch-xla-scan`: the same `nn.ModuleList` run by torch_xla's
  `experimental.scan_layers` (one scan, but it stacks the weights each step).

Models built with the same arguments start from the same weights in every mode.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torch_xla_ext.layer_stack import LayerStack
from torch_xla_ext.policies import checkpoint_name

MODES = ("loop", "scan", "torch-xla-scan")


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned per-feature scale."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class CausalSelfAttention(nn.Module):

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not a multiple of heads={heads}.")
        self.heads = heads
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """`attention_mask`, if given, is added to the scores (0 keeps, -inf masks)."""
        batch, seq, hidden = x.shape

        def split_heads(t):
            return t.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split_heads(self.q_proj(x)), split_heads(self.k_proj(x)), split_heads(self.v_proj(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        if attention_mask is not None:
            scores = scores + attention_mask
        attended = scores.softmax(dim=-1) @ v
        return self.o_proj(attended.transpose(1, 2).reshape(batch, seq, hidden))


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = checkpoint_name(F.silu(self.gate_proj(x)) * self.up_proj(x), "mlp_hidden")
        return self.down_proj(hidden)


class DecoderBlock(nn.Module):
    """Pre-norm decoder layer: causal self-attention then MLP, each with a residual."""

    def __init__(self, hidden: int, heads: int, intermediate: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = CausalSelfAttention(hidden, heads)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.mlp = MLP(hidden, intermediate or 4 * hidden)

    def forward(self, hidden_states: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # Names for the memory policies (torch_xla_ext.policies.save_only, offload).
        attn_out = checkpoint_name(
            self.self_attn(self.input_layernorm(hidden_states), attention_mask), "attn_out")
        hidden_states = hidden_states + attn_out
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class FusedQKVBlock(nn.Module):
    """A decoder layer written the common way rather than ours: one fused qkv
    projection, `nn.RMSNorm`, `F.scaled_dot_product_attention`, a GELU MLP."""

    def __init__(self, hidden: int, heads: int, intermediate: int | None = None):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not a multiple of heads={heads}.")
        self.heads = heads
        self.norm1 = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden)
        self.fc1 = nn.Linear(hidden, intermediate or 4 * hidden, bias=False)
        self.fc2 = nn.Linear(intermediate or 4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None):
        if attention_mask is not None:
            raise ValueError("FusedQKVBlock is causal and takes no attention_mask.")
        batch, seq, hidden = x.shape
        q, k, v = (self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, hidden // self.heads)
                   .permute(2, 0, 3, 1, 4))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class LlamaBlock(nn.Module):
    """transformers' own `LlamaDecoderLayer`, with the rotary table it is
    given by the model computed in the layer, so that it runs alone."""

    def __init__(self, hidden: int, heads: int, intermediate: int | None = None):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        config = LlamaConfig(hidden_size=hidden, num_attention_heads=heads,
                             num_key_value_heads=heads, intermediate_size=intermediate or 4 * hidden,
                             attn_implementation="sdpa")
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None):
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        output = self.layer(x, attention_mask=attention_mask, position_ids=positions,
                            position_embeddings=self.rotary(x, positions))
        return output[0] if isinstance(output, tuple) else output


# The layers a DecoderStack can be made of, by name.
BLOCKS = {"ours": DecoderBlock, "fused_qkv_sdpa": FusedQKVBlock, "llama": LlamaBlock}


class DecoderStack(nn.Module):
    """`num_layers` blocks (`BLOCKS[block]`) then a final norm, run as `mode`
    says (see MODES)."""

    def __init__(self, num_layers: int, hidden: int, heads: int, mode: str,
                 intermediate: int | None = None, block: str = "ours", unroll: int | bool = 1):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"Unknown mode {mode!r}; expected one of {MODES}.")
        if mode != "scan" and (unroll is True or unroll != 1):
            raise ValueError(f"unroll={unroll!r} is the LayerStack's (mode 'scan'); mode "
                             f"{mode!r} runs no loop it could unroll. Pass unroll=1.")
        if block not in BLOCKS:
            raise ValueError(f"Unknown block {block!r}; expected one of {tuple(BLOCKS)}.")
        self.mode = mode
        blocks = [BLOCKS[block](hidden, heads, intermediate) for _ in range(num_layers)]
        self.layers = (LayerStack(blocks, unroll=unroll) if mode == "scan"
                       else nn.ModuleList(blocks))
        self.norm = RMSNorm(hidden)

    def forward(self, hidden_states: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.mode == "loop":
            for layer in self.layers:
                hidden_states = layer(hidden_states, attention_mask)
        elif self.mode == "scan":
            hidden_states = self.layers(hidden_states, attention_mask)
        else:
            if attention_mask is not None:
                raise ValueError("torch_xla's scan_layers passes no extra arguments to the "
                                 "layers; use mode 'loop' or 'scan' with an attention_mask.")
            from torch_xla.experimental.scan_layers import scan_layers as torch_xla_scan_layers
            # Pure layers let torch_xla cache its trace across steps, its fastest setting.
            hidden_states = torch_xla_scan_layers(self.layers, hidden_states, is_layer_pure=True)
        return self.norm(hidden_states)


def make_decoder_stack(num_layers: int, hidden: int = 256, heads: int = 4,
                       mode: str = "loop", *, intermediate: int | None = None,
                       device=None, seed: int = 0, block: str = "ours",
                       unroll: int | bool = 1) -> DecoderStack:
    """A `DecoderStack` whose weights depend only on `seed`, the sizes and the
    block, not on `mode` (nor on `unroll`, the LayerStack's in mode "scan")."""
    torch.manual_seed(seed)
    return DecoderStack(num_layers, hidden, heads, mode, intermediate, block, unroll).to(device)


def make_batch(batch: int = 8, seq: int = 128, hidden: int = 256, *, device=None,
               seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (inputs, targets), each [batch, seq, hidden], made on the CPU from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch, seq, hidden, generator=generator)
    targets = torch.randn(batch, seq, hidden, generator=generator)
    return inputs.to(device), targets.to(device)


def training_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                  optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Forward, mean-squared-error loss, backward and optimizer step; returns the loss.

    Nothing is synced: on XLA the caller decides when the step's graph runs.
    """
    inputs, targets = batch
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss
