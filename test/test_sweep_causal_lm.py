"""scripts/sweep_causal_lm.py on a few tiny types: each type's worker trains it
unconverted and converted and the sweep classifies what stack_layers did (its
workers forked, benchmark_scripts.py); a worker that dies is classified by the
part it was in; and the configs are shrunk from each type's own, checked
without training."""
import json
import re

import pytest
import torch
import transformers

import benchmark_scripts
from benchmark_scripts import forked_workers  # noqa: F401 (a fixture)
import harness
import sweep_causal_lm
import sweep_configs
import sweep_worker


def test_llama_comes_out_scanned_and_equal_and_recurrent_gemma_layer_by_layer_with_its_reason(
        forked_workers, capsys, tmp_path):
    saved = tmp_path / "sweep.json"
    sweep_causal_lm.main(["--types", "llama", "--layers", "3", "--json", str(saved)])
    # --update runs another type into the saved sweep, and prints the whole.
    sweep_causal_lm.main(["--types", "recurrent_gemma", "--layers", "3", "--update", str(saved)])
    printed = capsys.readouterr().out
    assert re.search(r"^llama +scanned \(1 scan over 3 of 3 layers\)", printed, re.M), printed
    # RecurrentGemma's recurrent blocks keep their state on their own modules
    # (3 layers: two recurrent blocks and an attention one, its config's pattern).
    assert re.search(r"^recurrent_gemma +layer by layer: layer 0 sets its attributes "
                     r"\['temporal_block.conv1d_state'", printed, re.M), printed
    assert "2 types: 1 scanned, 0 partly scanned, 1 layer by layer, 0 refused" in printed
    assert "scanned: 1 of the 2 types whose unconverted model trains on XLA (50%)" in printed

    sweep = json.loads(saved.read_text())
    assert [command.split()[1:3] for command in sweep["commands"]] == [
        ["--types", "llama"], ["--types", "recurrent_gemma"]]
    results = sweep["results"]
    llama = results["llama"]["figures"]
    assert llama["layer_calls"] == 3 and llama["calls_outside"] == 0
    assert llama["scans"] == [{"steps": 3}] and llama["warnings"] == []
    assert all(diff["ok"] for diff in llama["diffs"].values()), llama["diffs"]
    losses = llama["losses"]
    assert losses["unconverted"][1] < losses["unconverted"][0]  # the steps trained
    assert losses["converted"] == pytest.approx(losses["unconverted"], rel=1e-4)
    recurrent = results["recurrent_gemma"]["figures"]
    assert recurrent["scans"] == [] and recurrent["calls_outside"] == recurrent["layer_calls"] == 3
    assert [each["category"] for each in recurrent["warnings"]] == ["LayerByLayerWarning"]
    assert all(diff["ok"] for diff in recurrent["diffs"].values()), recurrent["diffs"]

    # --report prints the saved sweep again, classified from its figures.
    sweep_causal_lm.main(["--report", str(saved), "--markdown"])
    reported = capsys.readouterr().out
    assert results["llama"]["line"] in reported and results["recurrent_gemma"]["line"] in reported
    assert "| scanned | 1 scan over 3 of 3 layers | 1: llama |" in reported


def worker_that_died(returncode, parts: list[str], last_line: str) -> harness.Outcome:
    stderr = "\n".join([*(sweep_worker.PART_MARK + part for part in parts), last_line])
    return harness.worker_outcome(returncode, "", stderr, 3.0, 60.0)


@pytest.mark.parametrize("returncode, parts, expected", [
    (-11, ["build", "unconverted", "convert", "converted"],
     ("crashed", "killed by SIGSEGV (in converted)")),
    (None, ["build", "unconverted", "convert"], ("crashed", "timed out after 60 s (in convert)")),
    (-6, ["build", "unconverted"], ("base fails", "unconverted: killed by SIGABRT")),
    (1, ["build"], ("base fails", "build: exit code 1: MemoryError: out of memory")),
])
def test_a_worker_that_died_is_classified_by_the_part_it_was_in(returncode, parts, expected):
    outcome = worker_that_died(returncode, parts, "MemoryError: out of memory")
    assert sweep_causal_lm.classify(outcome) == expected


def figures(**settings) -> dict:
    """A converted training's figures: 4 layer calls, all in one scan, equal."""
    equal = {"ok": True, "max_abs": 0.0, "max_rel": 0.0, "worst": None}
    return {"layer_calls": 4, "calls_outside": 0, "scans": [{"steps": 4}], "warnings": [],
            "diffs": {"losses": equal, "grads": equal, "weights": equal}, **settings}


def classified(**settings) -> tuple[str, str]:
    return sweep_causal_lm.classify(harness.Outcome(figures(**settings), harness.OK, "", 1.0))


def test_figures_are_classified_into_one_outcome_each():
    assert classified() == ("scanned", "1 scan over 4 of 4 layers")
    assert classified(scans=[{"steps": 2}, {"steps": 2}]) == (
        "scanned", "2 scans over 4 of 4 layers")
    warning = {"category": "LayerByLayerWarning",
               "message": "The 4 layers ran one by one, as the for loop does, instead of as one "
                          "scan: the layers run on cpu, and the scan is an XLA loop. More."}
    assert classified(scans=[], calls_outside=4, warnings=[warning]) == (
        "layer by layer", "the layers run on cpu, and the scan is an XLA loop")
    assert classified(scans=[], calls_outside=4) == (
        "layer by layer", "each layer ran as itself, no two neighbours alike, without a warning")
    assert classified(scans=[{"steps": 1}], calls_outside=3, warnings=[warning]) == (
        "partly scanned", "1 scan over 1 of 4 layers: the layers run on cpu, and the scan is "
                          "an XLA loop")
    off = {"ok": False, "max_abs": 0.5, "max_rel": 0.1, "worst": "lm_head.weight"}
    assert classified(diffs={**figures()["diffs"], "grads": off}) == (
        "wrong", "grads by 0.5 at lm_head.weight")
    assert classified(raised={"error": "TypeError: bad call (at x.py:3)"}) == (
        "raised", "TypeError: bad call (at x.py:3)")


@pytest.mark.parametrize("reasons, group", [
    (["found no decoder-layer nn.ModuleList in XLNetLMHeadModel (none holds layers of the "
      "classes it names in _no_split_modules: [])",
      "found no decoder-layer nn.ModuleList in JambaForCausalLM (none holds layers of the cl..."],
     "found no decoder-layer nn.ModuleList in <model>"),
    (["Layer 1 setting 'attn_residual_add_idx' is 4 but layer 0's is 2",
      "Layer 3 setting 'self_attn.use_rope' is 0 but layer 0's is 1"],
     "Layer N setting '...' is N but layer N's is N"),
    (["BloomModel.forward does more between two layers than call the next one (x.py:3: `if`)"],
     "<model>.forward does more between two layers than call the next one"),
])
def test_the_markdown_table_groups_reasons_that_differ_in_their_details(reasons, group):
    assert {sweep_causal_lm.reason_group(reason) for reason in reasons} == {group}


def test_differences_beyond_the_tolerance_are_found():
    expected = {"a": torch.ones(3), "b": torch.zeros(2)}
    within = {"a": torch.ones(3) + 5e-5, "b": torch.zeros(2)}
    beyond = {"a": torch.ones(3), "b": torch.tensor([0.0, 1e-3])}
    assert sweep_worker.difference(within, expected)["ok"]
    found = sweep_worker.difference(beyond, expected)
    assert not found["ok"] and found["worst"] == "b" and found["max_abs"] == pytest.approx(1e-3)
    assert "keys differ" in sweep_worker.difference({"a": torch.ones(3)}, expected)["worst"]


def built(config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_a_config_is_shrunk_from_its_own_sizes():
    config, changes = sweep_configs.small_config("mistral", 4)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim) == (4, 64, 4, 2, 16)
    # The intermediate size keeps its ratio to the hidden size (14336 / 4096).
    assert config.intermediate_size == 224 and config.vocab_size == sweep_configs.VOCAB
    assert config.sliding_window == sweep_configs.WINDOW and changes["hidden_size"] == 64
    assert sum(p.numel() for p in built(config).parameters()) < 10**6


def test_layer_kinds_of_the_whole_model_are_kept_in_the_few_layers():
    # Gemma3 (multimodal): its text config's pattern is 5 sliding layers, then a full one.
    config, _ = sweep_configs.small_config("gemma3", 4)
    text = config.text_config
    assert text.num_hidden_layers == 4 and text.hidden_size == 64
    assert text.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert config.vision_config.num_hidden_layers == 4 and config.vision_config.hidden_size == 64
    # Special token ids beyond the smaller vocabulary move to its top, above the inputs' range.
    limit = sweep_configs.input_id_limit(text.vocab_size)
    assert limit <= config.image_token_index < text.vocab_size
    # Kimi-Linear's first full-attention layer is its fifth; lists agree on the layers kept.
    config, _ = sweep_configs.small_config("kimi_linear", 4)
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert config.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    built(config)


def test_per_layer_lists_and_indices_follow_the_layers_kept():
    assert sweep_configs.kept_layers({"kinds": list("aaaaabaaaaab")}, 12, 4) == [0, 1, 2, 5]
    context = {"count": 8, "hidden": 64, "heads": 4}
    kept = [0, 1, 4, 5]
    assert sweep_configs.shrunk_value("full_attn_idxs", [3, 4, 7], 4, context, kept) == [2]
    assert sweep_configs.shrunk_value("per_layer_config", {"04": {"num_attention_heads": 32}},
                                      4, context, kept) == {"02": {"num_attention_heads": 4}}


def test_a_pattern_shorter_than_the_layers_repeats():
    # Nemotron-H's default is one layer of each kind, its layer count the
    # pattern's length (a property): 8 layers are its pattern twice.
    config, changes = sweep_configs.small_config("nemotron_h", 8)
    assert config.num_hidden_layers == 8
    assert config.layers_block_type == ["linear_attention", "moe", "full_attention", "mlp"] * 2
    assert sweep_configs.small_config("nemotron_h", 4)[0].num_hidden_layers == 4
    # Indices of the pattern's layers follow each repetition.
    context = {"count": 3, "hidden": 64, "heads": 4}
    kept = sweep_configs.kept_layers({"kinds": list("aab")}, 3, 6)
    assert kept == [0, 1, 2, 0, 1, 2]
    assert sweep_configs.shrunk_value("full_attn_idxs", [2], 6, context, kept) == [2, 5]
    assert sweep_configs.shrunk_value("per_layer_config", {"1": {"rope_theta": 1.0}}, 6, context,
                                      kept) == {"1": {"rope_theta": 1.0}, "4": {"rope_theta": 1.0}}


def test_tweaked_types_build_and_each_tweak_says_why():
    for model_type, (settings, reason) in sweep_configs.TWEAKS.items():
        assert settings and len(reason) > 20, model_type
    config, changes = sweep_configs.small_config("mamba2", 4)
    assert config.num_heads * config.head_dim == config.expand * config.hidden_size
    built(config)


def test_unknown_types_are_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        sweep_causal_lm.main(["--types", "llama,gpt3"])
    assert exited.value.code == 2 and "unknown model types ['gpt3']" in capsys.readouterr().err


def test_the_docs_show_the_saved_sweep_and_every_tweak():
    docs = (benchmark_scripts.REPO / "docs" / "sweep.md").read_text()
    for saved in ("before.json", "after.json"):
        _, results = sweep_causal_lm.saved_results(
            str(benchmark_scripts.REPO / "docs" / "sweep" / saved))
        assert sweep_causal_lm.markdown_table(results) in docs, saved
        for text in sweep_causal_lm.count_lines(results):
            assert text in docs, saved
    tweaked = re.findall(r"^\| ([\w, ]+) \| `", docs.split("## The tweaks")[1], re.M)
    assert {each for row in tweaked for each in row.split(", ")} == set(sweep_configs.TWEAKS)
