"""torch.compile of a model converted by stack_layers, with torch_xla's
`openxla` backend: Dynamo breaks its graph where the owner's loop over the
stacked layers starts (`layer_stack.owner_loops.at_graph_break`), the loop runs
as it does without torch.compile (its layers as one scan: a While loop
forward and one backward), and Dynamo compiles what comes before and after
it. A training step trains as the unconverted model's eager step does, and
neither Dynamo nor XLA compiles again after the first step. With
`trace_loops_in_dynamo`, `fullgraph=True` holds the loop as one node of
torch's scan operator (`openxla_scan` runs it)."""
import glob
import json

import torch

from optimized_hlo import dump_flags, while_loops

LAYERS, STEPS = 3, 3


def print_training_results(reference, model, losses, compilations, **more):
    """Prints, as JSON, what a scenario training `reference` and its converted
    `model` found: the `losses`, the largest weight difference after them and
    whether both state_dicts have the same names (the converted model's keep
    the unconverted per-layer names), Dynamo's recompiles, XLA's
    `compilations` after each step, and `more`."""
    import torch._dynamo.utils as dynamo_utils

    weights = [which.state_dict() for which in (reference, model)]
    print(json.dumps({
        "losses": losses,
        "weights": max((weights[1][name] - tensor).abs().max().item()
                       for name, tensor in weights[0].items()),
        "same_names": sorted(weights[0]) == sorted(weights[1]),
        "recompiles": sum(dynamo_utils.counters["recompiles"].values()),
        "compilations": compilations,
        **more,
    }))


def compiled_training_scenario():
    """Three SGD steps of an unconverted Llama run eagerly and of its
    converted copy under torch.compile; prints their losses, the largest
    weight difference after them, the LayerByLayerWarnings, Dynamo's
    recompiles, and XLA's compilations after each converted step, as JSON."""
    import copy
    import warnings

    import torch_xla
    import torch_xla.debug.metrics as metrics

    from test_hf import batch, make_model
    from torch_xla_ext.hf import stack_layers
    from torch_xla_ext.layer_stack import LayerByLayerWarning

    device = torch_xla.device()
    reference = make_model(layers=LAYERS).to(device)
    model = stack_layers(copy.deepcopy(make_model(layers=LAYERS))).to(device)
    ids, mask = batch(device)

    def step(which, optimizer):
        loss = which(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        return loss

    compiled = torch.compile(step, backend="openxla")
    optimizers = [torch.optim.SGD(which.parameters(), lr=0.1) for which in (reference, model)]
    losses, compilations = {"unconverted": [], "converted": []}, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            losses["unconverted"].append(step(reference, optimizers[0]).item())
            losses["converted"].append(compiled(model, optimizers[1]).item())
            compilations.append(metrics.metric_data("CompileTime")[0])
    print_training_results(reference, model, losses, compilations, one_by_one=[
        str(each.message) for each in caught if each.category is LayerByLayerWarning])


def test_a_compiled_training_step_runs_the_layers_as_loops_with_the_unconverted_results(
        run_isolated, tmp_path):
    result = run_isolated(compiled_training_scenario, env={"XLA_FLAGS": dump_flags(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["one_by_one"] == []
    assert found["losses"]["unconverted"][-1] < found["losses"]["unconverted"][0]
    assert found["losses"]["converted"] == found["losses"]["unconverted"]
    assert found["same_names"] and found["weights"] <= 1e-6
    # No recompile after the first step: Dynamo's guards hold, and XLA
    # compiles nothing new in the third step.
    assert found["recompiles"] == 0
    assert found["compilations"][2] == found["compilations"][1]
    # The layers ran as While loops over the 3 layers' stacked weights (the
    # key projections' [3, 16, 32]): a graph holds the forward loop and the
    # backward loop, none more (XLA compiles the loop's graphs apart from
    # Dynamo's, split at the break). XLA's own loops (its expansions of some
    # ops) carry no stacked buffer.
    graphs = [[stacked for _, stacked in while_loops(open(path).read(), LAYERS) if stacked]
              for path in glob.glob(f"{tmp_path}/*after_optimizations.txt")]
    looped = [loops for loops in graphs if loops]
    assert looped and max(len(loops) for loops in looped) == 2, looped
    assert all(("f32", "3,16,32") in stacked for loops in looped for stacked in loops), looped


def fullgraph_training_scenario():
    """Four SGD steps of an unconverted Llama (4 layers, hidden 64) run
    eagerly, and of its converted copy: the first eager (it plans this kind
    of call, its loops traced by Dynamo: `trace_loops_in_dynamo`), the others
    with the loss computed by `torch.compile(fullgraph=
    True, backend=openxla_scan)` (Dynamo traces no `backward()`); prints the
    losses, the largest weight difference, the scan nodes of each graph
    Dynamo made, Dynamo's recompiles and XLA's compilations, as JSON."""
    import copy

    import torch_xla
    import torch_xla.debug.metrics as metrics

    import torch_xla_ext as tx
    from test_hf import batch, make_model
    from torch_xla_ext.hf import stack_layers
    from torch_xla_ext.layer_stack import trace_loops_in_dynamo

    trace_loops_in_dynamo()
    device = torch_xla.device()
    config = dict(hidden_size=64, intermediate_size=128, attn_implementation="eager")
    reference = make_model(layers=4, **config)
    model = stack_layers(copy.deepcopy(reference)).to(device)
    reference.to(device)
    ids, mask = batch(device)
    scan_nodes = []

    def counting(graph_module, example_inputs):
        scan_nodes.append(sum(node.target is torch.ops.higher_order.scan
                              for node in graph_module.graph.nodes))
        return tx.openxla_scan(graph_module, example_inputs)

    def loss_of(which):
        return which(ids, attention_mask=mask, labels=ids).loss

    compiled = torch.compile(loss_of, backend=counting, fullgraph=True)

    def step(which, optimizer, loss_function):
        loss = loss_function(which)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        return loss.item()

    optimizers = [torch.optim.SGD(which.parameters(), lr=0.1) for which in (reference, model)]
    losses, compilations = {"unconverted": [], "converted": []}, []
    for number in range(4):
        losses["unconverted"].append(step(reference, optimizers[0], loss_of))
        losses["converted"].append(step(model, optimizers[1], loss_of if number == 0 else compiled))
        compilations.append(metrics.metric_data("CompileTime")[0])
    print_training_results(reference, model, losses, compilations, scan_nodes=scan_nodes)


def test_a_fullgraph_compiled_loss_holds_the_layers_as_one_scan_node(run_isolated, tmp_path):
    """Dynamo's graph holds the loop as one node of torch's scan operator
    (`layer_stack.dynamo`), which trains as the unconverted model."""
    result = run_isolated(fullgraph_training_scenario, env={"XLA_FLAGS": dump_flags(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["scan_nodes"] == [1]  # one graph, traced once
    assert found["losses"]["converted"] == found["losses"]["unconverted"]
    assert found["same_names"] and found["weights"] <= 1e-6
    assert found["recompiles"] == 0
    assert found["compilations"][3] == found["compilations"][2]
    # The compiled graphs (after the eager step's) each hold one loop over
    # the 4 layers' stacked key projections ([4, 32, 64]): forward, backward.
    paths = sorted(glob.glob(f"{tmp_path}/*after_optimizations.txt"))
    graphs = [[stacked for _, stacked in while_loops(open(path).read(), 4) if stacked]
              for path in paths]
    looped = [loops for loops in graphs if loops]
    assert [len(loops) for loops in looped][-2:] == [1, 1], looped
    assert all(("f32", "4,32,64") in stacked for loops in looped for stacked in loops), looped


def test_a_loop_dynamo_cannot_trace_says_why_when_its_kind_of_call_is_planned():
    """Gemma 3's sliding and full attention layers differ in settings, which
    one traced layer cannot stand for: with the switch on, the eager call
    that plans the kind of call warns that its loop will run at a graph break
    under torch.compile, naming the settings."""
    import warnings

    import torch_xla
    import transformers

    from test_hf import VOCAB, batch
    from torch_xla_ext.hf import stack_layers
    from torch_xla_ext.layer_stack import GraphBreakWarning, trace_loops_in_dynamo

    torch.manual_seed(0)
    model = stack_layers(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        attn_implementation="eager"))).to(torch_xla.device())
    ids, mask = batch(torch_xla.device())
    trace_loops_in_dynamo()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(ids, attention_mask=mask)
    finally:
        trace_loops_in_dynamo(False)
    messages = [str(each.message) for each in caught if each.category is GraphBreakWarning]
    assert len(messages) == 1 and "'layers' will run at a graph break" in messages[0], messages
    assert "self_attn.sliding_window" in messages[0], messages
