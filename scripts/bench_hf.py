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
sequences of 128 tokens. The columns are those of bench_layers.py, and:

* first step s: wall time of the first step, from the forward's call to the
              end of its execution: its trace, compile and run, what a user
              waits for before training runs (ratio goal <= 0.3 at L=32 and 64),
* python ms:  Python time of a steady step until just before `torch_xla.sync()`,
* compile s:  XLA compile time over all steps, compiles: their number (one
              of them, in every mode, is of the small graph that transformers'
              mask preparation runs to read the position ids; the ratios count
              the compilations of the step's graph alone),
* exec ms:    wall time of `torch_xla.sync()` + `wait_device_ops()` of a steady step,
* exec cpu ms: the process's CPU time (all threads) over the same span: the work
              done, which other tenants of a shared machine stretch far less,
* peak RSS:   peak resident memory during the last steady step.

Steady steps are the ones after the first two; figures are their medians. The
summary prints the ratios the issue asks for at L=32 and between L=64 and L=8;
with --rounds N, every (mode, L) runs N times and each ratio is the median of
the rounds', with their spread.

  python scripts/bench_hf.py              # L = 8, 32, 64
  python scripts/bench_hf.py --quick      # L = 2, 4: a quick check
  python scripts/bench_hf.py --family llama,qwen3,gemma2,gpt2 --lora
  python scripts/bench_hf.py --gradient-checkpointing --layers 16 --hidden 1024 --heads 8 \
      --kv-heads 8 --intermediate 4096 --seq 512 --batch 4 --steps 3   # bench_policies' sizes
"""
from __future__ import annotations

import dataclasses
import os
import statistics

import harness  # first: it sets the default device before torch_xla is imported
from torch_xla_ext import hf_workloads
from torch_xla_ext.hf_workloads import FAMILIES

MODES = ("loop", "stack_layers", "stack_layers+cache", "torch-xla-scan")
# The modes of --gradient-checkpointing.
CHECKPOINTING_MODES = ("stack_layers+save_nothing", "stack_layers+checkpointing")
CHECKPOINTING_RSS_GOAL = 1.05
# What LoRA adapts in each family: the attention's query and value projections.
LORA_TARGETS = {"gpt2": ["c_attn"], "bert": ["query", "value"], "t5": ["q", "v"]}
DEFAULT_LORA_TARGETS = ["q_proj", "v_proj"]
WARMUP_STEPS = 2
# Seconds one (mode, L) may take: the for loop at L=64 compiles for minutes.
DEFAULT_TIMEOUT = 1800
# The options a worker is given as the parent has them.
WORKLOAD_OPTIONS = ("steps", *harness.LLAMA_SIZE_OPTIONS, "seq", "batch")


def skipped_because(family: str, mode: str, lora: bool) -> str | None:
    """Why `mode` does not run for `family`, or None if it does."""
    if mode == "torch-xla-scan":
        unsupported = hf_workloads.torch_xla_scan_unsupported(family)
        if unsupported or lora:
            return unsupported or "the torch_xla scan_layers wrapper is not run with --lora"
    if mode == "stack_layers+cache" and family in hf_workloads.WITHOUT_CACHE:
        return f"{family} makes no cache"
    return None


def model_sizes(args) -> hf_workloads.ModelSizes:
    return hf_workloads.ModelSizes(**{field.name: getattr(args, field.name)
                                      for field in dataclasses.fields(hf_workloads.ModelSizes)})


def make_inputs(args, device) -> dict:
    """The keyword arguments of a training step of `args.family`, labels included."""
    return hf_workloads.training_inputs(args.family, args.vocab, args.batch, args.seq, device)


def make_model(args):
    """The model of `args.mode`, with weights that depend only on the sizes."""
    from torch_xla_ext import stack_layers

    model = hf_workloads.model_from_config(
        hf_workloads.family_config(args.family, model_sizes(args),
                                   use_cache=args.mode == "stack_layers+cache"),
        args.family)
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
        model.model.layers = hf_workloads.torch_xla_scan_layers_wrapper(model.model.layers)
    return model


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
        # What a user waits for before training runs: step one's trace, compile and execution.
        "first_step_s": times.total[0],
        "python_ms": 1e3 * statistics.median(times.build[steady]),
        "compile_s": compile_ns / 1e9,
        "compiles": compiles,
        # Compilations of the step's graph; the others are of graphs that the model's
        # forward runs to read values (transformers' mask preparation checks the
        # position ids), the same in every mode.
        "step_compiles": sum(step_compiles),
        "execute_ms": 1e3 * statistics.median(times.finish[steady]),
        "execute_cpu_ms": 1e3 * statistics.median(times.finish_cpu[steady]),
        "peak_rss_mib": peak_rss_bytes() / 2**20,
        "peak_is_steady": times.peak_is_last_steps,
        "param_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        # The modes compute the same steps from the same weights: their last losses agree.
        "last_loss": times.last_built.item(),
    }


def print_ratios(rounds: list[dict[tuple[str, int], dict]], layer_counts: list[int],
                 steps: int, modes: list[str], markdown: bool) -> None:
    """The ratios against their goals, each the median over `rounds` (figures by
    (mode, L)); a markdown table with `markdown`."""
    print("\nRatios" + (f", median of {len(rounds)} rounds (spread):" if len(rounds) > 1
                         else ":"))
    print(harness.goal_table(goals(rounds, layer_counts, steps, modes), markdown))


def goals(rounds: list[dict[tuple[str, int], dict]], layer_counts: list[int],
          steps: int, modes: list[str]) -> list[harness.Goal]:
    """The ratios (and the step's compilation count) against their goals."""
    middle = 32 if 32 in layer_counts else max(layer_counts)
    smallest, largest = min(layer_counts), max(layer_counts)
    checked = []

    def check(label, value, goal):
        checked.append(harness.Goal(label, value, goal))

    def ratio(label, numerator, denominator, figure, goal):
        checked.append(harness.goal_over_rounds(label, rounds, numerator, denominator, figure,
                                                goal))

    converted = ("stack_layers", middle)
    if "stack_layers+checkpointing" in modes:
        ratio(f"peak RSS checkpointing/save_nothing at L={middle}",
              ("stack_layers+checkpointing", middle), ("stack_layers+save_nothing", middle),
              "peak_rss_mib", CHECKPOINTING_RSS_GOAL)
        return checked
    ratio(f"python time stack_layers/loop at L={middle}", converted, ("loop", middle),
          "python_ms", 0.1)
    ratio(f"compile time stack_layers/loop at L={middle}", converted, ("loop", middle),
          "compile_s", 0.3)
    for figure, what in (("execute_ms", "execution"), ("execute_cpu_ms", "execution CPU time")):
        ratio(f"{what} stack_layers/loop at L={middle}", converted, ("loop", middle), figure,
              1.15)
    for layers in sorted({middle, largest}):
        ratio(f"first step (trace+compile+run) stack_layers/loop L={layers}",
              ("stack_layers", layers), ("loop", layers), "first_step_s", 0.3)
    ratio(f"compile time stack_layers L={largest}/L={smallest}", ("stack_layers", largest),
          ("stack_layers", smallest), "compile_s", 1.3)
    last = rounds[-1]  # a count, the same in every round
    check(f"step graph compilations in {steps} steps, stack_layers L={middle}",
          last[converted]["step_compiles"] if converted in last else None, 1)
    if "stack_layers+cache" not in modes:
        return checked
    with_cache = ("stack_layers+cache", middle)
    ratio(f"compile time stack_layers+cache/stack_layers at L={middle}", with_cache, converted,
          "compile_s", 1.10)
    for figure, what in (("execute_ms", "execution"), ("execute_cpu_ms", "execution CPU time")):
        ratio(f"{what} stack_layers+cache/stack_layers at L={middle}", with_cache, converted,
              figure, 1.05)
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
    harness.add_rounds_option(parser)
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
        every_round = harness.measure_rounds(
            os.path.abspath(__file__), family_modes, layer_counts,
            [*harness.passed_on(args, WORKLOAD_OPTIONS), "--family", family,
             *(["--lora"] if args.lora else [])], args.timeout, args.rounds, family,
            lambda outcomes: harness.print_layer_table(outcomes, args.markdown))
        print_ratios([harness.figures_by_run(outcomes) for outcomes in every_round],
                     layer_counts, args.steps, family_modes, args.markdown)
        for outcomes in every_round:
            all_outcomes.update({(f"{family} {mode}", layers): outcome
                                 for (mode, layers), outcome in outcomes.items()})
    harness.exit_if_runs_failed(parser.prog, all_outcomes)


if __name__ == "__main__":
    main()
