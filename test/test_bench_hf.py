"""scripts/bench_hf.py on a tiny LlamaForCausalLM: every mode trains the same
steps in a process of its own, and the table and the issue's ratios are
printed. The command line runs in pytest's process, its workers forked
(benchmark_scripts.py)."""
import argparse
import re
import warnings

import pytest
import torch_xla

from benchmark_scripts import forked_workers, worker_figures  # noqa: F401 (a fixture)
from support import supports
import bench_hf
from torch_xla_ext.layer_stack import LayerByLayerWarning

TINY = ["--steps", "3", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "64", "--vocab", "64", "--seq", "8", "--batch", "2"]


def test_every_mode_trains_the_same_steps(scenario_server):
    figures = {mode: worker_figures(scenario_server, "bench_hf.py", "--mode", mode,
                                    "--layers", "2", *TINY)
               for mode in bench_hf.MODES}
    losses = {mode: f["last_loss"] for mode, f in figures.items()}
    for mode in ("stack_layers", "stack_layers+cache", "torch-xla-scan"):
        assert abs(losses[mode] - losses["loop"]) < 1e-4, losses
    # The step's graph compiles once; without a cache, the model's own mask probe
    # adds one small graph (with one, transformers skips the probe).
    for mode in ("stack_layers", "stack_layers+cache"):
        assert figures[mode]["step_compiles"] == 1, figures[mode]
    assert figures["stack_layers"]["compiles"] == figures["loop"]["compiles"]
    assert figures["stack_layers+cache"]["compiles"] == figures["loop"]["compiles"] - 1


# Families whose LoRA targets are not the default q_proj and v_proj.
@supports("LoRA", ["gpt2", "bert"])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_lora_on_other_families_trains_the_same_steps_converted(scenario_server, family):
    figures = {mode: worker_figures(scenario_server, "bench_hf.py", "--mode", mode, "--layers",
                                    "2", "--family", family, "--lora", *TINY)
               for mode in ("loop", "stack_layers")}
    assert abs(figures["stack_layers"]["last_loss"] - figures["loop"]["last_loss"]) < 1e-4
    assert figures["stack_layers"]["step_compiles"] == 1, figures


NEW_FAMILIES = ["mixtral", "qwen3_moe", "bert", "vit", "t5"]


def tiny_args(**settings) -> argparse.Namespace:
    """The worker's options as bench_hf.main parses them from TINY and `settings`."""
    options = dict(zip((option.lstrip("-").replace("-", "_") for option in TINY[::2]),
                       map(int, TINY[1::2])))
    return argparse.Namespace(**{**options, "lora": False, **settings})


@supports("training", NEW_FAMILIES)
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_moe_and_encoder_families_train_the_same_steps_as_one_scan(scenario_server, family):
    # Trained converted with recomputation (the forward and backward of plain
    # stack_layers, and the scan's save_nothing policy); T5's, whose block 0
    # checkpoints by itself, is tested against torch_xla's checkpoint in test_hf_t5.py.
    converted = "stack_layers" if family == "t5" else "stack_layers+checkpointing"
    # T5's block 0 (it holds the relative attention bias) runs as itself: with
    # three blocks, the other two are a scan.
    layers = 3 if family == "t5" else 2
    figures = {mode: worker_figures(scenario_server, "bench_hf.py", "--mode", mode, "--layers",
                                    str(layers), "--family", family, *TINY)
               for mode in ("loop", converted)}
    assert abs(figures[converted]["last_loss"] - figures["loop"]["last_loss"]) < 1e-4, figures
    assert figures[converted]["step_compiles"] == 1, figures
    # The converted forward, on the benchmark's own model and inputs, is one
    # while loop per layer list and runs no layer one by one.
    args = tiny_args(family=family, layers=layers, mode="stack_layers")
    device = torch_xla.device()
    model = bench_hf.make_model(args).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayerByLayerWarning)
        loss = model(**bench_hf.make_inputs(args, device)).loss
    assert "while" in torch_xla._XLAC._get_xla_tensors_hlo([loss])


def test_the_table_and_ratios_are_printed(forked_workers, capsys):
    bench_hf.main(["--layers", "2", "--modes", "stack_layers", *TINY])
    printed = capsys.readouterr().out
    # first step s, python ms, compile s, compiles
    assert re.search(r"^stack_layers  2 +[\d.]+ +[\d.]+ +[\d.]+ +\d+ ", printed,
                     re.MULTILINE), printed
    # Ratios against a mode that did not run say so; the compilation count needs none.
    assert "python time stack_layers/loop at L=2" in printed
    assert "first step (trace+compile+run) stack_layers/loop L=2" in printed
    assert "n/a (missing run)" in printed
    assert "step graph compilations in 3 steps, stack_layers L=2" in printed


def test_gradient_checkpointing_is_measured_beside_save_nothing(forked_workers, capsys):
    bench_hf.main(["--gradient-checkpointing", "--layers", "2", *TINY])
    printed = capsys.readouterr().out
    for mode in bench_hf.CHECKPOINTING_MODES:
        assert re.search(rf"^{re.escape(mode)} +2 +[\d.]+ ", printed, re.MULTILINE), printed
    assert re.search(r"peak RSS checkpointing/save_nothing at L=2 +\d\.\d{3} +goal <= 1\.05 +"
                     r"(ok|MISSED)$", printed, re.MULTILINE), printed
    assert "python time stack_layers/loop" not in printed


@pytest.mark.parametrize("arguments, message", [
    (["--modes", "loop,bogus"], "unknown modes ['bogus']"),
    (["--family", "llama,gpt3"], "unknown families ['gpt3']"),
])
def test_unknown_modes_and_families_are_refused(arguments, message, capsys):
    with pytest.raises(SystemExit) as exited:
        bench_hf.main(arguments)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_encoders_say_they_run_no_cache_mode(capsys):
    bench_hf.main(["--family", "bert,vit", "--modes", "stack_layers+cache", "--layers", "2", *TINY])
    printed = capsys.readouterr().out
    for family in ("bert", "vit"):
        assert f"not stack_layers+cache: {family} makes no cache" in printed, printed
    assert "stack_layers+cache/stack_layers" not in printed
