"""`openxla_scan`: a `torch.compile` backend that does what torch_xla's
`openxla` does, with each call of torch's scan operator run as one While loop.

`openxla` is AOTAutograd (which splits the graph into a forward and a backward
graph) with each graph handed to torch_xla's dynamo bridge, which runs it once
on XLA tensors, compiles the lazy graph that results and replays it at later
calls. The bridge first splits a graph into the parts XLA can run and the
parts it runs on the CPU; a scan node's body is a `get_attr` of a submodule,
which the split passes into its part as an argument, and the bridge accepts
only tensors and numbers as arguments. So before handing a graph over,
`openxla_scan` makes each scan node a call of a callable that holds its body
(in the bodies too, for nested scans): the node then runs `scan` with the body
when the bridge runs the graph, and its loops are part of the compiled graph.

Gradients: AOTAutograd differentiates the operator before the backend sees it,
with torch's rule (`dispatch` gives it carries that carry gradients): the
forward loop keeps each step's carry, and the backward graph holds a second
scan (over the steps reversed) that recomputes each step and differentiates
it. Both run as loops here; a registration's `partition_fn` does not apply (a
warning says so), its `unroll` does. The options are those in effect when the
graph compiles.
"""
from __future__ import annotations

import functools
import warnings

import torch

from torch_xla_ext import policies
from torch_xla_ext.torch_scan import dispatch
from torch_xla_ext.torch_scan.translation import LoopOptions, run_as_loop


def openxla_scan(graph_module: torch.fx.GraphModule, example_inputs):
    """`torch.compile(fn, backend=openxla_scan)`: torch_xla's `openxla`
    backend, with torch's scan operator run as `torch_xla_ext.scan`."""
    with dispatch.tracing_for_backend():
        return _aot_backend()(graph_module, example_inputs)


@functools.cache
def _aot_backend():
    from torch._dynamo.backends.common import aot_autograd
    return aot_autograd(fw_compiler=_compile_graph)


def _compile_graph(graph_module: torch.fx.GraphModule, example_inputs):
    from torch._dynamo.backends.torchxla import openxla_eval_boxed
    options = dispatch.active() or LoopOptions()
    if _keep_scan_bodies(graph_module, options) and (
            options.partition_fn is not policies.save_everything):
        warnings.warn(
            f"openxla_scan: partition_fn={options.partition_fn!r} of register_torch_scan has "
            f"no effect on a compiled graph: AOTAutograd differentiates torch's scan operator "
            f"before the backend sees it (its forward loop keeps each step's carry, its "
            f"backward loop recomputes the step); unroll={options.unroll!r} applies",
            dispatch.TorchScanWarning, stacklevel=2)
    return openxla_eval_boxed(graph_module, example_inputs)


class _ScanAsLoop:
    """A scan node's target once its body is kept: `scan_op(body, ...)` run
    as `torch_xla_ext.scan`."""

    def __init__(self, body: torch.fx.GraphModule, options: LoopOptions):
        self.body = body
        self.options = options
        self.__name__ = "scan_as_loop"  # how the graph's code names it

    def __call__(self, init, xs, additional_inputs):
        return run_as_loop(self.body, init, xs, additional_inputs, self.options)


def _keep_scan_bodies(graph_module: torch.fx.GraphModule, options: LoopOptions) -> bool:
    """Makes each scan node of the graph (and of its bodies) call a `_ScanAsLoop`
    holding its body; returns whether there was one."""
    found = False
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.higher_order.scan:
            continue
        body_node, *arguments = node.args
        body = graph_module.get_submodule(body_node.target)
        _keep_scan_bodies(body, options)
        node.target = _ScanAsLoop(body, options)
        node.args = tuple(arguments)
        found = True
    if found:
        graph_module.graph.eliminate_dead_code()
        graph_module.delete_all_unused_submodules()
        graph_module.recompile()
    return found
