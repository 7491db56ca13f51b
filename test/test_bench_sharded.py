"""scripts/bench_sharded.py on a tiny Llama and 4 virtual devices: a mesh's
two modes train the same steps, and the table of per-device bytes and
collectives and the ratios against their goals are printed. The command
line runs in pytest's process, its workers forked (benchmark_scripts.py)."""
import re

import pytest

from benchmark_scripts import forked_workers  # noqa: F401 (a fixture)
import bench_sharded

TINY = ["--devices", "4", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "64", "--vocab", "64", "--seq", "8", "--batch", "4"]


def test_a_mesh_is_measured_in_both_modes_with_its_ratios(forked_workers, capsys):
    bench_sharded.main(["--meshes", "fsdp", "--policies", "save_everything", *TINY])
    printed = capsys.readouterr().out
    rows = {mode: re.search(rf"^fsdp +save_everything +{mode} +([\d.]+) +(\d+) +([\d.]+) +"
                            rf"[\d/]+ +0 +[\d.]+ +([\d.]+)$", printed, re.MULTILINE)
            for mode in bench_sharded.MODES}
    assert all(rows.values()), printed
    assert rows["loop"].group(4) == rows["stack_layers"].group(4), printed  # the same losses
    for figure in ("device bytes", "collective bytes"):
        assert re.search(rf"^  {figure} stack_layers/loop, fsdp save_everything +\d+\.\d{{3}} +"
                         rf"goal <= 1\.0 +(ok|MISSED)$", printed, re.MULTILINE), printed
    assert re.search(r"^  whole-stack gathers, fsdp +0\.000 +goal <= 0 +ok$", printed,
                     re.MULTILINE), printed


def test_the_loop_runs_each_program_once_for_the_policies_compared():
    assert bench_sharded.runs(["model"], ["save_everything", "save_nothing", "checkpointing"]) == [
        ("model", "save_everything", "loop"), ("model", "save_everything", "stack_layers"),
        ("model", "save_nothing", "stack_layers"), ("model", "checkpointing", "loop"),
        ("model", "checkpointing", "stack_layers")]


@pytest.mark.parametrize("name, spec_set, spec", [
    ("model.layers.0.self_attn.q_proj.weight", "megatron", ("model", "fsdp")),
    ("model.layers.0.mlp.down_proj.weight", "tensor-only", (None, "model")),
    ("model.embed_tokens.weight", "megatron", ("model", "fsdp")),
    ("model.layers.0.input_layernorm.weight", "megatron", None),
    ("model.layers.2.post_attention_layernorm.weight", "with-norms", ("model",)),
    ("model.layers.1.self_attn.o_proj.weight", "both-axes", (None, ("fsdp", "model"))),
])
def test_weights_are_cut_by_their_role_as_the_spec_set_says(name, spec_set, spec):
    assert bench_sharded.weight_spec(name, bench_sharded.SPEC_SETS[spec_set]) == spec


def test_the_2d_mesh_runs_once_per_spec_set():
    assert bench_sharded.mesh_labels(["fsdp", "fsdp+model"], ["megatron"]) == ["fsdp",
                                                                              "fsdp+model"]
    labels = bench_sharded.mesh_labels(["fsdp+model", "model"], ["megatron", "fsdp-only"])
    assert labels == ["fsdp+model:megatron", "fsdp+model:fsdp-only", "model"]
    assert [bench_sharded.spec_set_of(label) for label in labels] == [
        ("fsdp+model", "megatron"), ("fsdp+model", "fsdp-only"), ("model", "tensor-only")]


@pytest.mark.parametrize("arguments, message", [
    (["--meshes", "fsdp,ring"], "--meshes: unknown ['ring']"),
    (["--policies", "save_dots"], "--policies: unknown ['save_dots']"),
    (["--specs", "megatron,zero"], "--specs: unknown ['zero']"),
])
def test_unknown_meshes_and_policies_are_refused(arguments, message, capsys):
    with pytest.raises(SystemExit) as exited:
        bench_sharded.main(arguments)
    assert exited.value.code == 2 and message in capsys.readouterr().err
