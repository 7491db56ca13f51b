"""scripts/bench_hf.py end to end on a tiny LlamaForCausalLM: every mode runs in
its own process through the shared harness, trains the same steps, and the
table and the issue's ratios are printed."""
import json
import os
import subprocess
import sys

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
TINY = ["--steps", "3", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "64", "--vocab", "64", "--seq", "8", "--batch", "2"]


def run_script(*arguments, timeout=600):
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_hf.py"), *arguments],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PJRT_DEVICE": "CPU"})


def worker_figures(mode):
    done = run_script("--worker", "--mode", mode, "--layers", "2", *TINY)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("benchmark worker"))
    return json.loads(line.partition(": ")[2])


def test_the_three_modes_train_the_same_steps():
    figures = {mode: worker_figures(mode) for mode in ("loop", "stack_layers", "torch-xla-scan")}
    losses = {mode: f["last_loss"] for mode, f in figures.items()}
    assert abs(losses["stack_layers"] - losses["loop"]) < 1e-4, losses
    assert abs(losses["torch-xla-scan"] - losses["loop"]) < 1e-4, losses
    # The step's graph compiles once; the model's own mask probe adds one small graph.
    assert figures["stack_layers"]["step_compiles"] == 1
    assert figures["stack_layers"]["compiles"] == figures["loop"]["compiles"]


def test_the_table_and_ratios_are_printed():
    done = run_script("--layers", "2", "--modes", "stack_layers", *TINY)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stack_layers       2" in done.stdout
    # Ratios against a mode that did not run say so; the compilation count needs none.
    assert "python time stack_layers/loop at L=2" in done.stdout
    assert "n/a (missing run)" in done.stdout
    assert "step graph compilations in 3 steps, stack_layers L=2" in done.stdout
    done = run_script("--modes", "loop,bogus")
    assert done.returncode == 2 and "unknown modes ['bogus']" in done.stderr
