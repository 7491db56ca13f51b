"""scripts/bench_generate.py on a tiny LlamaForCausalLM: every mode generates
in a process of its own, the same tokens, and the table and the issue's ratios
are printed. The command line runs in pytest's process, its workers forked
(benchmark_scripts.py)."""
import re

import pytest

from benchmark_scripts import forked_workers, worker_figures  # noqa: F401 (a fixture)
import bench_generate

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
                         "--rounds", "2", *TINY])
    printed = capsys.readouterr().out
    assert printed.count("\nRuns, round ") == 2 and "Runs, round 2 of 2" in printed
    assert len(re.findall(r"^stack_layers\+tx-generate  2 +[\d.]+ +[\d.]+ +\d+ ", printed,
                          re.MULTILINE)) == 2, printed
    assert "Ratios, median of 2 rounds (spread):" in printed
    # ms/token is a difference of two timings; with 2 new tokens on a busy
    # machine it can come out below zero, so either sign is a printed ratio.
    assert re.search(r"ms/token stack_layers\+tx-generate/tx-generate at L=2 +-?[\d.]+ .*"
                     r"\(-?[\d.]+--?[\d.]+\)", printed), printed
    assert "first call stack_layers+hf-generate/hf-generate at L=2" in printed
    assert "n/a (missing run)" in printed
    assert "Tokens: every mode gave the same tokens" in printed


def test_too_few_new_tokens_are_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        bench_generate.main(["--new-tokens", "1"])
    assert exited.value.code == 2 and "--new-tokens must be at least 2" in capsys.readouterr().err
