"""scripts/bench_export.py on a tiny LlamaForCausalLM: each mode exports and
lowers in a process of its own (forked, benchmark_scripts.py), the converted
model as one scan node and one While loop, with the unconverted logits."""
from benchmark_scripts import worker_figures

TINY = ["--hidden", "32", "--heads", "4", "--kv-heads", "2", "--intermediate", "64",
        "--vocab", "64", "--seq", "8", "--batch", "2"]


def test_each_mode_exports_and_lowers_with_the_models_logits(scenario_server):
    figures = {(mode, layers): worker_figures(scenario_server, "bench_export.py", "--mode", mode,
                                              "--layers", str(layers), *TINY)
               for mode in ("loop", "stack_layers") for layers in (2, 3)}
    for (mode, layers), found in figures.items():
        assert found["max_diff"] < 1e-5, (mode, layers, found)
        scanned = mode == "stack_layers"
        assert (found["scan_nodes"], found["whiles"]) == ((1, 1) if scanned else (0, 0)), found
    # The converted graph is one layer whatever the depth; the loop's grows.
    assert figures["stack_layers", 2]["nodes"] == figures["stack_layers", 3]["nodes"]
    assert figures["loop", 3]["nodes"] > figures["loop", 2]["nodes"]
