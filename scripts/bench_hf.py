#!/usr/bin/env python
"""Benchmark a training step of transformers models (LlamaForCausalLM by
default; --family llama,qwen3,gemma2,gemma3,qwen2-window,gpt2,mixtral,qwen3_moe,
bert,vit; --lora) four ways.

* loop:            the model as transformers builds it (its forward's for loop
                   over the decoder layers),
* stack_layers:    the same model after `torch_xla_ext.stack_layers(model)`
                   (its own forward, the layers as one scan, stacked weights),
* stack_layers+cache: stack_layers with the config's `use_cache=True` (most
                   configs' default): the model makes itself a DynamicCache
                   each step, which the scan fills (causal LMs only),
* torch-xla-scan:  the layers run by torch_xla's `scan_layers`, through a small
                   wrapper module put in place of `model.model.layers` that
                   broadcasts the extra arguments (rotary embeddings, mask) to
                   every layer through the carry, as users do today
                   (Llama's layer call, without --lora; skipped otherwise).

--gradient-checkpointing measures two other modes instead, side by side:

* stack_layers+save_nothing: stack_layers(model, partition_fn="save_nothing"),
* stack_layers+checkpointing: stack_layers(model), then transformers'
                   `model.gradient_checkpointing_enable()`, which makes the
                   scan recompute each layer as save_nothing does; its peak RSS
                   should be save_nothing's (within 5%).

--family runs each family in turn, at the same sizes (hidden, heads,
intermediate, vocab; GPT-2, BERT and ViT have as many key/value heads as
heads), dropout off;
gemma3 (text) has its default pattern of 5 sliding-window layers and 1 full,
qwen2-window full attention in its first half and a window of half the
sequence in the rest. mixtral and qwen3_moe have 4 experts of --intermediate
(2 per token) in every layer, built with experts_implementation="batched_mm",
transformers' one implementation with static shapes (the others run the
converted layers one by one). bert is BertForMaskedLM on a padded batch (the
sequences from the full length down to half of it, the labels the tokens,
-100 at padding), vit ViTForImageClassification on random images of
floor(sqrt(seq))^2 patches of 16x16 pixels (and its class token), --vocab
classes. T5 is not here: stack_layers does not convert encoder-decoder models.
--lora trains LoRA adapters (peft, r=8, on the attention's query and value
projections; GPT-2's fused c_attn) in every mode: get_peft_model first, then
stack_layers; only the adapters are trained.

Each (mode, L) runs in a fresh process (scripts/harness.py, within --timeout
seconds) on the device PJRT_DEVICE names, CPU if it is not set: build the model
from a config with random weights (hidden 256, 4 heads, 2 key/value heads,
intermediate 512, vocab 1024, use_cache=False), then run `--steps` training
steps (forward with labels, the model's loss, backward, SGD) on a batch of 8
sequences of 128 tokens. The columns are those of bench_layers.py:

* python ms:  Python time of a steady step until just before `torch_xla.sync()`,
* compile s:  XLA compile time over all steps, compiles: their number (one
              of them, in every mode, is of the small graph that transformers'
              mask preparation runs to read the position ids; the ratios count
              the compilations of the step's graph alone),
* exec ms:    wall time of `torch_xla.sync()` + `wait_device_ops()` of a steady step,
* peak RSS:   peak resident memory during the last steady step.

Steady steps are the ones after the first two; figures are their medians. The
summary prints the ratios the issue asks for at L=32 and between L=64 and L=8.

  python scripts/bench_hf.py              # L = 8, 32, 64
  python scripts/bench_hf.py --quick      # L = 2, 4: a quick check
  python scripts/bench_hf.py --family llama,qwen3,gemma2,gpt2 --lora
  python scripts/bench_hf.py --gradient-checkpointing --layers 16 --hidden 1024 --heads 8 \
      --kv-heads 8 --intermediate 4096 --seq 512 --batch 4 --steps 3   # bench_policies' sizes
"""
from __future__ import annotations

import math
import os
import statistics

import harness  # first: it sets the default device before torch_xla is imported

MODES = ("loop", "stack_layers", "stack_layers+cache", "torch-xla-scan")
# The modes of --gradient-checkpointing.
CHECKPOINTING_MODES = ("stack_layers+save_nothing", "stack_layers+checkpointing")
CHECKPOINTING_RSS_GOAL = 1.05
FAMILIES = ("llama", "qwen3", "gemma2", "gemma3", "qwen2-window", "gpt2", "mixtral",
            "qwen3_moe", "bert", "vit")
# The transformers auto class of each family that is not a causal LM.
AUTO_CLASSES = {"bert": "AutoModelForMaskedLM", "vit": "AutoModelForImageClassification"}
DEFAULT_AUTO_CLASS = "AutoModelForCausalLM"
# Mixture-of-experts families: their experts, and the experts implementation
# whose shapes do not depend on the routing, so that the layers scan.
MOE_FAMILIES = ("mixtral", "qwen3_moe")
EXPERTS, EXPERTS_PER_TOKEN = 4, 2
EXPERTS_IMPLEMENTATION = "batched_mm"
VIT_PATCH = 16
# What LoRA adapts in each family: the attention's query and value projections.
LORA_TARGETS = {"gpt2": ["c_attn"], "bert": ["query", "value"]}
DEFAULT_LORA_TARGETS = ["q_proj", "v_proj"]
WARMUP_STEPS = 2
# Seconds one (mode, L) may take: the for loop at L=64 compiles for minutes.
DEFAULT_TIMEOUT = 1800
# The options a worker is given as the parent has them.
WORKLOAD_OPTIONS = ("steps", *harness.LLAMA_SIZE_OPTIONS, "seq", "batch")


def skipped_because(family: str, mode: str, lora: bool) -> str | None:
    """Why `mode` does not run for `family`, or None if it does."""
    if mode == "torch-xla-scan" and (family != "llama" or lora):
        return "the torch_xla scan_layers wrapper knows Llama's layer call only, without --lora"
    if mode == "stack_layers+cache" and family in AUTO_CLASSES:
        return f"{family} makes no cache"
    return None


def model_config(args, use_cache: bool):
    """The config of `args.family` with `args.layers` layers at the sizes of `args`."""
    import transformers

    if args.family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
            n_inner=args.intermediate, n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, use_cache=use_cache)
    if args.family == "llama":
        return harness.llama_config(args, use_cache=use_cache)
    if args.family == "bert":
        return transformers.BertConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, intermediate_size=args.intermediate,
            max_position_embeddings=args.seq, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
    if args.family == "vit":
        return transformers.ViTConfig(
            hidden_size=args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=args.heads, intermediate_size=args.intermediate,
            image_size=vit_image_size(args.seq), patch_size=VIT_PATCH, num_labels=args.vocab,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config_class, settings = {
        "qwen3": (transformers.Qwen3Config, {}),
        "gemma2": (transformers.Gemma2Config, {}),
        "gemma3": (transformers.Gemma3TextConfig, {}),
        # The first half of the layers full attention, the rest a sliding window
        # shorter than the sequence.
        "qwen2-window": (transformers.Qwen2Config, dict(
            use_sliding_window=True, max_window_layers=args.layers // 2,
            sliding_window=args.seq // 2)),
        "mixtral": (transformers.MixtralConfig, dict(
            num_local_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN)),
        "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
            moe_intermediate_size=args.intermediate, num_experts=EXPERTS,
            num_experts_per_tok=EXPERTS_PER_TOKEN)),
    }[args.family]
    return config_class(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        use_cache=use_cache, **settings)


def vit_image_size(seq: int) -> int:
    """The side in pixels of square images of floor(sqrt(seq))^2 patches."""
    return math.isqrt(seq) * VIT_PATCH


def make_inputs(args, device) -> dict:
    """The keyword arguments of a training step of `args.family`, labels included."""
    import torch

    generator = torch.Generator().manual_seed(1)
    if args.family == "vit":
        side = vit_image_size(args.seq)
        return {"pixel_values": torch.randn(args.batch, 3, side, side,
                                            generator=generator).to(device),
                "labels": torch.randint(0, args.vocab, (args.batch,),
                                        generator=generator).to(device)}
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    if args.family != "bert":
        return {"input_ids": tokens.to(device), "labels": tokens.to(device)}
    # A padded batch: lengths from the full sequence down to half of it.
    lengths = torch.linspace(args.seq, args.seq // 2, args.batch).round().long()
    attention_mask = (torch.arange(args.seq) < lengths[:, None]).long()
    return {"input_ids": tokens.to(device), "attention_mask": attention_mask.to(device),
            "labels": tokens.masked_fill(attention_mask == 0, -100).to(device)}


def make_model(args):
    """The model of `args.mode`, with weights that depend only on the sizes."""
    import torch
    import transformers

    from torch_xla_ext import stack_layers

    torch.manual_seed(0)
    auto_class = getattr(transformers, AUTO_CLASSES.get(args.family, DEFAULT_AUTO_CLASS))
    model = auto_class.from_config(
        model_config(args, use_cache=args.mode == "stack_layers+cache"),
        **({"experts_implementation": EXPERTS_IMPLEMENTATION}
           if args.family in MOE_FAMILIES else {}))
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=8, lora_dropout=0.0,
            target_modules=LORA_TARGETS.get(args.family, DEFAULT_LORA_TARGETS)))
    if args.mode == "stack_layers+save_nothing":
        stack_layers(model, partition_fn="save_nothing")
    elif args.mode == "stack_layers+checkpointing":
        stack_layers(model).gradient_checkpointing_enable()
    elif args.mode.startswith("stack_layers"):
        stack_layers(model)
    elif args.mode == "torch-xla-scan":
        model.model.layers = torch_xla_scan_layers_wrapper(model.model.layers)
    return model


def torch_xla_scan_layers_wrapper(layers):
    """A module in place of the decoder-layer list that runs the layers with
    torch_xla's scan_layers, which passes a layer nothing but its carry: each
    layer is wrapped to take the extra arguments from the carry and return
    them with the new hidden state."""
    from torch import nn
    from torch_xla.experimental.scan_layers import scan_layers

    class BroadcastArguments(nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, hidden_states, cos, sin, *attention_mask):
            hidden_states = self.layer(hidden_states, position_embeddings=(cos, sin),
                                       attention_mask=attention_mask[0] if attention_mask else None)
            return (hidden_states, cos, sin, *attention_mask)

    class ScannedLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(BroadcastArguments(layer) for layer in layers)

        def __getitem__(self, index):
            # The model's `for decoder_layer in self.layers[: n]` gets this one callable.
            return [self]

        def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **_):
            carry = (hidden_states, *position_embeddings,
                     *(() if attention_mask is None else (attention_mask,)))
            # Pure layers let torch_xla cache its trace across steps, its fastest setting.
            return scan_layers(self.layers, carry, is_layer_pure=True)[0]

    return ScannedLayers()


def run_worker(args) -> dict:
    """One (mode, L) measurement in this process; returns the figures."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from torch_xla_ext.metrics import peak_rss_bytes

    device = torch_xla.device()
    model = make_model(args).to(device).train()
    inputs = make_inputs(args, device)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    torch_xla.sync()
    xm.wait_device_ops()
    met.clear_all()

    def compilations() -> int:
        return (met.metric_data("CompileTime") or (0,))[0]

    def build_step():
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        return loss

    step_compiles = []

    def run_step():
        compiles_before_sync = compilations()
        torch_xla.sync()
        xm.wait_device_ops()
        step_compiles.append(compilations() - compiles_before_sync)

    # Released before the timer starts: freeing large buffers is allocator time.
    times = harness.time_steps(args.steps, build_step, run_step,
                               prepare=lambda step: optimizer.zero_grad(set_to_none=True))

    compiles, compile_ns, _ = met.metric_data("CompileTime") or (0, 0, None)
    steady = slice(WARMUP_STEPS, None)
    return {
        "python_ms": 1e3 * statistics.median(times.build[steady]),
        "compile_s": compile_ns / 1e9,
        "compiles": compiles,
        # Compilations of the step's graph; the others are of graphs that the model's
        # forward runs to read values (transformers' mask preparation checks the
        # position ids), the same in every mode.
        "step_compiles": sum(step_compiles),
        "execute_ms": 1e3 * statistics.median(times.finish[steady]),
        "peak_rss_mib": peak_rss_bytes() / 2**20,
        "peak_is_steady": times.peak_is_last_steps,
        "param_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        # The modes compute the same steps from the same weights: their last losses agree.
        "last_loss": times.last_built.item(),
    }


def print_ratios(by_key: dict[tuple[str, int], dict], layer_counts: list[int],
                 steps: int, modes: list[str], markdown: bool) -> None:
    """The ratios against their goals, a markdown table with `markdown`."""
    print("\nRatios:")
    print(harness.goal_table(goals(by_key, layer_counts, steps, modes), markdown))


def goals(by_key: dict[tuple[str, int], dict], layer_counts: list[int],
          steps: int, modes: list[str]) -> list[harness.Goal]:
    """The ratios (and the step's compilation count) against their goals."""
    middle = 32 if 32 in layer_counts else max(layer_counts)
    smallest, largest = min(layer_counts), max(layer_counts)
    checked = []

    def check(label, value, goal):
        checked.append(harness.Goal(label, value, goal))

    def ratio(label, numerator, denominator, figure, goal):
        check(label, harness.ratio(by_key, numerator, denominator, figure), goal)

    converted = ("stack_layers", middle)
    if ("stack_layers+checkpointing", middle) in by_key:
        ratio(f"peak RSS checkpointing/save_nothing at L={middle}",
              ("stack_layers+checkpointing", middle), ("stack_layers+save_nothing", middle),
              "peak_rss_mib", CHECKPOINTING_RSS_GOAL)
        return checked
    ratio(f"python time stack_layers/loop at L={middle}", converted, ("loop", middle),
          "python_ms", 0.1)
    ratio(f"compile time stack_layers/loop at L={middle}", converted, ("loop", middle),
          "compile_s", 0.3)
    ratio(f"execution stack_layers/loop at L={middle}", converted, ("loop", middle),
          "execute_ms", 1.15)
    ratio(f"compile time stack_layers L={largest}/L={smallest}", ("stack_layers", largest),
          ("stack_layers", smallest), "compile_s", 1.3)
    check(f"step graph compilations in {steps} steps, stack_layers L={middle}",
          by_key[converted]["step_compiles"] if converted in by_key else None, 1)
    if "stack_layers+cache" not in modes:
        return checked
    with_cache = ("stack_layers+cache", middle)
    ratio(f"compile time stack_layers+cache/stack_layers at L={middle}", with_cache, converted,
          "compile_s", 1.10)
    ratio(f"execution stack_layers+cache/stack_layers at L={middle}", with_cache, converted,
          "execute_ms", 1.10)
    return checked


def main(argv: list[str] | None = None) -> None:
    parser = harness.benchmark_parser(__file__, __doc__)
    harness.add_layer_and_mode_options(parser, (*MODES, *CHECKPOINTING_MODES))
    parser.set_defaults(modes=",".join(MODES))
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help=f"measure {' and '.join(CHECKPOINTING_MODES)} instead of --modes")
    parser.add_argument("--steps", type=int, default=5)
    harness.add_llama_size_options(parser)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--family", default="llama",
                        help=f"comma-separated families among {', '.join(FAMILIES)}")
    parser.add_argument("--lora", action="store_true",
                        help="train LoRA adapters (peft) instead of every weight")
    harness.add_worker_options(parser, DEFAULT_TIMEOUT)
    args = parser.parse_args(argv)

    if args.worker:
        args.layers = int(args.layers)
        harness.report_result(run_worker(args))
        return

    if args.gradient_checkpointing:
        args.modes = ",".join(CHECKPOINTING_MODES)
    layer_counts, modes = harness.chosen_runs(parser, args, (*MODES, *CHECKPOINTING_MODES),
                                              WARMUP_STEPS)
    families = args.family.split(",")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")

    training = "LoRA r=8" if args.lora else "every weight"
    print(f"PJRT {harness.device_name()}, hidden {args.hidden}, {args.heads} heads, "
          f"{args.kv_heads} key/value heads, intermediate {args.intermediate}, vocab "
          f"{args.vocab}, seq {args.seq}, batch {args.batch}, SGD on {training}, {args.steps} "
          f"steps (first {WARMUP_STEPS} not steady)", flush=True)
    all_outcomes = {}
    for family in families:
        skipped = {mode: skipped_because(family, mode, args.lora) for mode in modes}
        family_modes = [mode for mode in modes if not skipped[mode]]
        print(f"\n{family}{' with LoRA' if args.lora else ''}: modes {', '.join(family_modes)}"
              + "".join(f"; not {mode}: {reason}" for mode, reason in skipped.items() if reason),
              flush=True)
        outcomes = harness.measure_modes_and_depths(
            os.path.abspath(__file__), family_modes, layer_counts,
            [*harness.passed_on(args, WORKLOAD_OPTIONS), "--family", family,
             *(["--lora"] if args.lora else [])], args.timeout)
        print()
        harness.print_layer_table(outcomes, args.markdown)
        print_ratios({key: outcome.figures for key, outcome in outcomes.items() if outcome.ok},
                     layer_counts, args.steps, family_modes, args.markdown)
        all_outcomes.update({(f"{family} {mode}", layers): outcome
                             for (mode, layers), outcome in outcomes.items()})
    harness.exit_if_runs_failed(parser.prog, all_outcomes)


if __name__ == "__main__":
    main()
