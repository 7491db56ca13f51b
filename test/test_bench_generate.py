"""scripts/bench_generate.py on a tiny LlamaForCausalLM: every mode generates
in a process of its own, the same tokens, and the table and the issue's ratios
are printed. The command line runs in pytest's process, its workers forked
(benchmark_scripts.py)."""
import re

import pytest

from benchmark_scripts import forked_workers, op_times_rows, worker_figures  # noqa: F401 (a fixture)
import bench_generate
from bench_generate import decode_step_bytes

TINY = ["--prompt", "6", "--new-tokens", "2", "--repeats", "1", "--hidden", "32", "--heads", "4",
        "--kv-heads", "2", "--intermediate", "64", "--vocab", "64"]


def test_the_modes_give_the_same_tokens_and_ours_compile_one_decoding_step(scenario_server):
    figures = {mode: worker_figures(scenario_server, "bench_generate.py", "--mode", mode,
                                    "--layers", "2", *TINY)
               for mode in bench_generate.MODES}
    tokens = {mode: f["tokens"] for mode, f in figures.items()}
    assert len({str(t) for t in tokens.values()}) == 1, tokens
    assert len(tokens["hf-generate"][0]) == 6 + 2
    # transformers' generate() compiles a graph for nearly every token, and the
    # converted model as many; torch_xla_ext.generate one decoding step.
    assert (figures["stack_layers+hf-generate"]["compiles"]
            <= figures["hf-generate"]["compiles"])
    assert figures["stack_layers+tx-generate"]["compiles"] < figures["hf-generate"]["compiles"]
    # Warm timings for our modes only (at these sizes, the per-token figure, a
    # difference of two timings, is mostly noise).
    for mode in ("stack_layers+tx-generate", "tx-generate"):
        assert figures[mode]["prefill_ms"] > 0 and isinstance(figures[mode]["token_ms"], float)
    assert "token_ms" not in figures["hf-generate"]
    # The memory limit of the decode, for our modes only: the reads of a step
    # at these sizes are the model's bytes (decode_step_bytes), bandwidth any.
    for mode in ("stack_layers+tx-generate", "tx-generate"):
        f = figures[mode]
        assert f["step_read_mib"] == pytest.approx(
            decode_step_bytes(tiny_model(layers=2), batch=1, cache_positions=6 + 2 / 2) / 2**20)
        assert f["bandwidth_gbs"] > 0
        assert f["roofline_ms"] == pytest.approx(
            f["step_read_mib"] * 2**20 / (f["bandwidth_gbs"] * 1e9) * 1e3)
        if f["token_ms"] > 0:  # a difference of two timings: see below
            assert f["limit_fraction"] == pytest.approx(f["roofline_ms"] / f["token_ms"])
        else:
            assert f["limit_fraction"] is None
    assert "roofline_ms" not in figures["hf-generate"]


def test_generate_with_the_default_cache_gives_the_same_tokens_compiling_no_more_graphs(
        scenario_server):
    figures = {mode: worker_figures(scenario_server, "bench_generate.py", "--mode", mode,
                                    "--layers", "2", "--cache", "dynamic", *TINY)
               for mode in ("hf-generate", "stack_layers+hf-generate")}
    assert figures["stack_layers+hf-generate"]["tokens"] == figures["hf-generate"]["tokens"]
    assert (figures["stack_layers+hf-generate"]["compiles"]
            <= figures["hf-generate"]["compiles"])


def test_the_tables_ratios_over_rounds_and_token_check_are_printed(forked_workers, capsys):
    bench_generate.main(["--layers", "2", "--modes", "stack_layers+tx-generate,tx-generate",
                         "--rounds", "2", "--op-times", *TINY])
    printed = capsys.readouterr().out
    assert printed.count("\nRuns, round ") == 2 and "Runs, round 2 of 2" in printed
    assert len(re.findall(r"^stack_layers\+tx-generate  2 +[\d.]+ +[\d.]+ +\d+ ", printed,
                          re.MULTILINE)) == 2, printed
    assert "Ratios, median of 2 rounds (spread):" in printed
    # ms/token is a difference of two timings; with 2 new tokens on a busy
    # machine it can come out below zero, so either sign is a printed ratio.
    assert re.search(r"ms/token stack_layers\+tx-generate/tx-generate at L=2 +-?[\d.]+ .*"
                     r"\(-?[\d.]+--?[\d.]+\)", printed), printed
    # Only the goals of the modes run: none of hf-generate's.
    assert "hf-generate" not in printed.split("Ratios, median")[1], printed
    assert re.search(r"roofline ms/token +of limit", printed), printed
    assert re.search(r"of limit stack_layers\+tx-generate at L=2 \(aim 0\.8\) +"
                     r"(n/a|[\d.]+ +goal >= 0\.5 )", printed), printed
    assert "Tokens: every mode gave the same tokens" in printed
    # Where a one-token call's time went: the same products; only the
    # converted model reads its weights as slices of the stacks.
    rows, busy = op_times_rows(printed.splitlines(), (
        "Where a one-token call's time went (the prefill and its choice), op by op (count and "
        "wall ms of each kind of op, per call; last round):"))
    assert rows["dot"][0] == rows["dot"][2] != "0", rows
    assert rows["dynamic-slice_bitcast_fusion"][0] != "0", rows
    assert rows["dynamic-slice_bitcast_fusion"][2] == "0", rows
    assert all(float(ms) > 0 for ms in busy)


def tiny_model(layers: int):
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2))


def test_a_decoding_steps_reads_are_the_weights_and_the_filled_cache():
    import torch_xla_ext as tx

    per_layer = (32 * 32 + 2 * 32 * 8 * 2 + 32 * 32  # q, k and v (2 heads of 8), o
                 + 3 * 32 * 64 + 2 * 32)              # gate, up, down, two norms
    weights = 4 * (3 * per_layer + 2 * 64 * 32 + 32)  # float32; embeddings, lm_head, norm
    # At each of 5.5 positions, for each of 2 rows, the keys and values of the
    # 2 heads of 8 in each of the 3 layers.
    cache = 4 * 5.5 * 2 * 3 * 2 * 2 * 8
    model = tiny_model(layers=3)
    assert decode_step_bytes(model, batch=2, cache_positions=5.5) == weights + cache
    tx.stack_layers(model)  # the same weights, stacked
    assert decode_step_bytes(model, batch=2, cache_positions=5.5) == weights + cache


def test_too_few_new_tokens_are_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        bench_generate.main(["--new-tokens", "1"])
    assert exited.value.code == 2 and "--new-tokens must be at least 2" in capsys.readouterr().err
