"""Dynamo's trace of an owner's loop over its stacked layers
(layer_stack.dynamo, with `trace_loops_in_dynamo`): what the forward reads
of its loop items (`decoder_layer.attention_type`) is decided by the eager
call that planned the kind of call. Plain values are constants of Dynamo's
graph, which holds the loop as one scan node; anything else keeps the loop at
a graph break, with a GraphBreakWarning that names it; an attribute that
eager call did not read raises an AttributeError that says what to do."""
import copy
import warnings

import pytest
import torch
import torch_xla
from torch import nn

import torch_xla_ext as tx
from layer_calls import HIDDEN, Block
from tolerances import TRAINING, close
from torch_xla_ext.layer_stack import (
    GraphBreakWarning, OwnerPlans, StackedList, drive_loops, trace_loops_in_dynamo)

# The attribute the forward reads of each loop item (tests change it between calls).
READ = {"name": "kind"}


class KindBlock(Block):
    kind = "scaled"


class Reading(nn.Module):
    """Calls its blocks in turn, each with the scale that its attribute
    `READ["name"]` picks (as transformers' models pick a layer's mask)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(KindBlock() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            value = getattr(block, READ["name"])
            x = block(x, scale=2.0 if value == "scaled" else 1.0, shift=0.5)
        return x


@pytest.fixture
def device():
    trace_loops_in_dynamo()
    READ["name"] = "kind"
    torch._dynamo.reset()
    yield torch_xla.device()
    trace_loops_in_dynamo(False)
    READ["name"] = "kind"
    torch._dynamo.reset()


def converted(device):
    """The unconverted model, its converted copy, and the copy's plans."""
    model = Reading()
    stacked = copy.deepcopy(model)
    stacked.blocks = StackedList(stacked.blocks)
    plans = OwnerPlans()
    drive_loops(stacked, ("blocks",), plans.start, plans.traced)
    return model.to(device), stacked.to(device), plans


def scan_counting(scan_nodes: list):
    def backend(graph_module, example_inputs):
        scan_nodes.append(sum(node.target is torch.ops.higher_order.scan
                              for node in graph_module.graph.nodes))
        return tx.openxla_scan(graph_module, example_inputs)
    return backend


def test_plain_attributes_the_loop_reads_are_constants_of_one_scan_node(device):
    reference, model, plans = converted(device)
    x = torch.randn(2, HIDDEN, device=device)
    close(model(x), reference(x), TRAINING)  # plans this kind of call
    (loop,) = plans.traced_runs.values()
    assert loop["blocks"].attributes == {index: {"kind": "scaled"} for index in range(3)}
    scan_nodes = []
    compiled = torch.compile(model, backend=scan_counting(scan_nodes), fullgraph=True)
    for _ in range(2):
        close(compiled(x), reference(x), TRAINING)
    assert scan_nodes == [1]


def test_a_loop_reading_a_module_of_its_layers_stays_at_a_graph_break_and_says_why(device):
    READ["name"] = "norm"
    reference, model, plans = converted(device)
    x = torch.randn(2, HIDDEN, device=device)
    with pytest.warns(GraphBreakWarning, match="layer 0's attribute 'norm', a LayerNorm"):
        close(model(x), reference(x), TRAINING)
    scan_nodes = []
    compiled = torch.compile(model, backend=scan_counting(scan_nodes))
    close(compiled(x), reference(x), TRAINING)
    assert sum(scan_nodes) == 0


def test_an_attribute_the_planning_call_did_not_read_raises_under_dynamo(device):
    _, model, _ = converted(device)
    x = torch.randn(2, HIDDEN, device=device)
    model(x)
    READ["name"] = "training"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dynamo's graph break on the exception
        with pytest.raises(AttributeError, match="'training'.*call the model eagerly first"):
            torch.compile(model, backend=tx.openxla_scan)(x)
    # With fullgraph, Dynamo reports the exception its trace met with the message.
    torch._dynamo.reset()
    with pytest.raises(Exception, match="call the model eagerly first"):
        torch.compile(model, backend=tx.openxla_scan, fullgraph=True)(x)
