#!/usr/bin/env python
"""Benchmark greedy generation with transformers' LlamaForCausalLM four ways.

* hf-generate:               the model as transformers builds it, through its
                             `generate(..., cache_implementation="static")`
                             (with `--cache dynamic`, its default cache),
* stack_layers+hf-generate:  the model after `torch_xla_ext.stack_layers`,
                             through the same `generate()`,
* stack_layers+tx-generate:  the converted model through `torch_xla_ext.generate`
                             (one compiled decoding step, the stacked static
                             cache written in place),
* tx-generate:               the unconverted model through `torch_xla_ext.generate`
                             (the per-token execution time to compare with).

Each (mode, L) runs in a fresh process (scripts/harness.py, within --timeout
seconds) on the device PJRT_DEVICE names, CPU if it is not set: build the model
from a config with random weights (the sizes of bench_hf.py: hidden 256, 4
heads, 2 key/value heads, intermediate 512, vocab 1024), then generate
`--new-tokens` tokens after a prompt of `--prompt` tokens (batch `--batch`):

* first call s:  wall time of the first call, compilation included,
* compile s, compiles: XLA compile time and compilations of the first call,
* again s:       wall time of a second, identical call (nothing left to compile),
* prefill ms:    a call that makes one token (the prefill and its choice), in a
                 warm process (the tx modes),
* ms/token:      (a call of all the new tokens - a call of one) / the tokens
                 after the first: the steady decoding step (the tx modes),
* peak RSS:      peak resident memory of the process,
* step reads MiB: the bytes a decoding step must read: every weight once,
                 and the keys and values of the cache's filled part at the
                 decode's mean position (prompt + new tokens / 2), for every
                 row, in the model's dtype (the tx modes),
* copy GB/s:     the host's memory bandwidth, measured after the decode in the
                 same process: bytes read + bytes written per second by a
                 numpy copy of a buffer as large as a step's reads (at least
                 256 MiB), the best of 5 copies; one thread,
* roofline ms/token: step reads / copy bandwidth: the per-token time of a
                 decode that only waits for memory,
* of limit:      roofline ms/token / ms/token: the fraction of that limit the
                 decode reaches (- when ms/token, a difference of two
                 timings, is not positive).

With `--op-times` (the tx modes), each run then records two one-token calls
under torch_xla's profiler, and the script prints where their time went, op
by op, in the last round (`torch_xla_ext.metrics.op_times`): each kind of
op's count and its share of the time any op ran, a column per run.

Warm figures are medians of --repeats calls. Every mode must give the same
tokens (the script fails otherwise). The summary prints the ratios the issue
asks for at L=32 (the deepest L if there is no 32) and between the
deepest and the shallowest L; with --rounds N every run is made
N times, round after round, and each ratio is the median of the rounds'
ratios, printed with their spread (min-max).

  python scripts/bench_generate.py              # L = 8, 32, 64
  python scripts/bench_generate.py --quick      # L = 2, 4: a quick check
  python scripts/bench_generate.py --modes stack_layers+hf-generate,stack_layers+tx-generate,tx-generate --rounds 3
  python scripts/bench_generate.py --cache dynamic --modes hf-generate,stack_layers+hf-generate
  python scripts/bench_generate.py --modes tx-generate,stack_layers+tx-generate --layers 16 \
      --hidden 1024 --heads 8 --kv-heads 8 --intermediate 2816 --prompt 384 --new-tokens 128
                                                # near the memory limit
"""
from __future__ import annotations

import os
import statistics
import time

import harness  # first: it sets the default device before torch_xla is imported

MODES = ("hf-generate", "stack_layers+hf-generate", "stack_layers+tx-generate", "tx-generate")
# Seconds one (mode, L) may take: the unconverted model at L=64 compiles a
# graph of 64 layers for nearly every token.
DEFAULT_TIMEOUT = 3600
WORKLOAD_OPTIONS = ("prompt", "new_tokens", "batch", "repeats", "cache", "op_times",
                    *harness.LLAMA_SIZE_OPTIONS)
# The buffer the memory bandwidth is measured with is at least this large, so
# that the processor's caches hold little of it.
BANDWIDTH_MIN_BYTES = 256 * 2**20
BANDWIDTH_COPIES = 5


def decode_step_bytes(model, batch: int, cache_positions: float) -> float:
    """The bytes a decoding step of `model` (a transformers decoder, converted
    or not) must read: each of its weights once, and the keys and values of
    `cache_positions` positions in every layer for `batch` rows, in the
    model's dtype (as a StaticCache holds them). The input embedding counts
    whole, though a step reads only its tokens' rows of it: at most
    vocab x hidden more than the least, little beside the layers."""
    weights = sum(parameter.numel() * parameter.element_size()
                  for parameter in model.parameters())
    config = model.config
    head_dim = (getattr(config, "head_dim", None)
                or config.hidden_size // config.num_attention_heads)
    position = (2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
                * model.dtype.itemsize)
    return weights + batch * cache_positions * position


def memory_bandwidth(buffer_bytes: float) -> float:
    """The host's memory bandwidth in bytes per second, counting bytes read and
    bytes written: the best of BANDWIDTH_COPIES numpy copies of a buffer of
    `buffer_bytes` (at least BANDWIDTH_MIN_BYTES), after one that maps its pages."""
    import numpy

    source = numpy.ones(max(int(buffer_bytes), BANDWIDTH_MIN_BYTES), dtype=numpy.uint8)
    target = numpy.empty_like(source)
    numpy.copyto(target, source)
    seconds = []
    for _ in range(BANDWIDTH_COPIES):
        started = time.perf_counter()
        numpy.copyto(target, source)
        seconds.append(time.perf_counter() - started)
    return 2 * source.nbytes / min(seconds)


def run_worker(args) -> dict:
    """One (mode, L) measurement in this process; returns the figures."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import transformers

    import torch_xla_ext as tx
    from torch_xla_ext.metrics import peak_rss_bytes

    device = torch_xla.device()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        harness.llama_config(args, use_cache=True, eos_token_id=None))
    if args.mode.startswith("stack_layers"):
        tx.stack_layers(model)
    model = model.to(device).eval()
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt),
                           generator=torch.Generator().manual_seed(1)).to(device)
    torch_xla.sync()
    xm.wait_device_ops()

    def generate(new_tokens: int) -> torch.Tensor:
        if args.mode.endswith("tx-generate"):
            return tx.generate(model, prompt, new_tokens,
                               max_cache_len=args.prompt + args.new_tokens)
        cache = {"cache_implementation": "static"} if args.cache == "static" else {}
        with torch.no_grad():
            tokens = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                                    pad_token_id=0, **cache)
        torch_xla.sync()
        return tokens

    def timed(new_tokens: int) -> tuple[float, list]:
        started = time.perf_counter()
        tokens = generate(new_tokens).cpu().tolist()
        return time.perf_counter() - started, tokens

    met.clear_all()
    first_s, tokens = timed(args.new_tokens)
    compiles, compile_ns, _ = met.metric_data("CompileTime") or (0, 0, None)
    figures = {"first_call_s": first_s, "compile_s": compile_ns / 1e9, "compiles": compiles,
               "again_s": timed(args.new_tokens)[0], "tokens": tokens}
    if args.mode.endswith("tx-generate"):
        whole = [timed(args.new_tokens)[0] for _ in range(args.repeats)]
        one = [timed(1)[0] for _ in range(args.repeats)]
        figures["prefill_ms"] = 1e3 * statistics.median(one)
        figures["token_ms"] = (1e3 * (statistics.median(whole) - statistics.median(one))
                               / (args.new_tokens - 1))
        if args.op_times:
            figures["op_times"] = harness.op_time_figures(lambda: generate(1))
    figures["peak_rss_mib"] = peak_rss_bytes() / 2**20
    if args.mode.endswith("tx-generate"):
        # After the peak RSS: the copy's buffers are not the decode's memory.
        figures.update(roofline(model, args, figures["token_ms"]))
    return figures


def roofline(model, args, token_ms: float) -> dict:
    """The decode's memory limit: a step's reads at the mean position of the
    decode, the bandwidth, the per-token time they allow, and the fraction of
    it `token_ms` reaches (None when `token_ms` is not positive)."""
    step_bytes = decode_step_bytes(model, args.batch, args.prompt + args.new_tokens / 2)
    bandwidth = memory_bandwidth(step_bytes)
    roofline_ms = 1e3 * step_bytes / bandwidth
    return {"step_read_mib": step_bytes / 2**20, "bandwidth_gbs": bandwidth / 1e9,
            "roofline_ms": roofline_ms,
            "limit_fraction": roofline_ms / token_ms if token_ms > 0 else None}


def print_table(outcomes, markdown: bool) -> None:
    def warm(figure, digits):
        return lambda r: f"{r[figure]:.{digits}f}" if r.get(figure) is not None else "-"

    harness.print_runs_table(outcomes, [
        ("first call s", lambda r: f"{r['first_call_s']:.2f}"),
        ("compile s", lambda r: f"{r['compile_s']:.2f}"),
        ("compiles", lambda r: str(r["compiles"])),
        ("again s", lambda r: f"{r['again_s']:.2f}"),
        ("prefill ms", warm("prefill_ms", 1)),
        ("ms/token", warm("token_ms", 2)),
        ("peak RSS MiB", lambda r: f"{r['peak_rss_mib']:.0f}"),
        ("step reads MiB", warm("step_read_mib", 1)),
        ("copy GB/s", warm("bandwidth_gbs", 1)),
        ("roofline ms/token", warm("roofline_ms", 2)),
        ("of limit", warm("limit_fraction", 2)),
    ], markdown)


def print_ratios(rounds: list[dict], layer_counts: list[int], modes: list[str],
                 markdown: bool) -> None:
    """The goal lines of the `modes` run, each ratio the median over `rounds`
    (figures by (mode, L))."""
    middle = 32 if 32 in layer_counts else max(layer_counts)
    smallest, largest = min(layer_counts), max(layer_counts)
    goals = []

    def ratio(label, numerator, denominator, figure, goal):
        if numerator[0] in modes and denominator[0] in modes:
            goals.append(harness.goal_over_rounds(label, rounds, numerator, denominator,
                                                  figure, goal))

    print("\nRatios" + (f", median of {len(rounds)} rounds (spread)" if len(rounds) > 1
                        else "") + ":")
    ratio(f"first call stack_layers+hf-generate/hf-generate at L={middle}",
          ("stack_layers+hf-generate", middle), ("hf-generate", middle), "first_call_s", 0.3)
    for mode in ("stack_layers+hf-generate", "stack_layers+tx-generate"):
        ratio(f"compile time {mode} L={largest}/L={smallest}", (mode, largest),
              (mode, smallest), "compile_s", 1.3)
    ours, unconverted = ("stack_layers+tx-generate", middle), ("tx-generate", middle)
    ratio(f"ms/token stack_layers+tx-generate/tx-generate at L={middle}", ours, unconverted,
          "token_ms", 1.0)
    ratio(f"prefill stack_layers+tx-generate/tx-generate at L={middle}", ours, unconverted,
          "prefill_ms", 1.0)
    if ours[0] in modes:
        fraction, spread = harness.median_and_spread(
            [(figures.get(ours) or {}).get("limit_fraction") for figures in rounds])
        goals.append(harness.Goal(f"of limit stack_layers+tx-generate at L={middle} (aim 0.8)",
                                  fraction, 0.5, spread, minimum=True))
    ratio(f"peak RSS stack_layers+tx-generate/hf-generate at L={middle}", ours,
          ("hf-generate", middle), "peak_rss_mib", 1.05)
    print(harness.goal_table(goals, markdown))


def tokens_problem(outcomes) -> str | None:
    """Which runs gave other tokens than the first run at the same depth, if any."""
    different = []
    for (mode, layers), outcome in outcomes.items():
        if not outcome.ok:
            continue
        first = next(o for (m, n), o in outcomes.items() if n == layers and o.ok)
        if outcome.figures["tokens"] != first.figures["tokens"]:
            different.append(f"{mode} L={layers}")
    return f"tokens differ from the first mode's: {', '.join(different)}" if different else None


def main(argv: list[str] | None = None) -> None:
    parser = harness.benchmark_parser(__file__, __doc__)
    harness.add_layer_and_mode_options(parser, MODES)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", choices=("static", "dynamic"), default="static",
                        help="the cache of the hf-generate modes' generate(): static (the "
                             "default, transformers' advice on XLA) or dynamic (its default); "
                             "torch_xla_ext.generate always uses a static one")
    harness.add_op_times_option(parser, "one-token calls (prefill and choice)")
    harness.add_rounds_option(parser)
    harness.add_llama_size_options(parser)
    harness.add_worker_options(parser, DEFAULT_TIMEOUT)
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2: the steady step is timed after the first")

    if args.worker:
        args.layers = int(args.layers)
        harness.report_result(run_worker(args))
        return

    layer_counts, modes = harness.chosen_runs(parser, args, MODES, None)
    print(f"PJRT {harness.device_name()}, {harness.llama_description(args)}; greedy, batch "
          f"{args.batch}, prompt {args.prompt} tokens, {args.new_tokens} new tokens, "
          f"generate() with a {args.cache} cache", flush=True)
    every_round = harness.measure_rounds(
        os.path.abspath(__file__), modes, layer_counts,
        harness.passed_on(args, WORKLOAD_OPTIONS), args.timeout, args.rounds, "Runs",
        lambda outcomes: print_table(outcomes, args.markdown))
    rounds = [harness.figures_by_run(outcomes) for outcomes in every_round]
    print_ratios(rounds, layer_counts, modes, args.markdown)
    if args.op_times:
        print("\nWhere a one-token call's time went (the prefill and its choice), op by op "
              "(count and wall ms of each kind of op, per call; last round):")
        harness.print_op_times(rounds[-1], args.markdown)
    problems = [tokens_problem(outcomes) for outcomes in every_round]
    print("\nTokens: " + ("; ".join(filter(None, problems)) or "every mode gave the same tokens"))
    for outcomes in every_round:
        harness.exit_if_runs_failed(parser.prog, outcomes)
    harness.exit_on_problems(parser.prog, problems)


if __name__ == "__main__":
    main()
