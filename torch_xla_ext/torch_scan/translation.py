"""A call of torch's scan operator as a call of `torch_xla_ext.scan`.

The operator, `torch.ops.higher_order.scan(combine_fn, init, xs,
additional_inputs)`, works on flat lists: `combine_fn(*carry, *x,
*additional_inputs)` returns the new carry's leaves, then the step's outputs;
it steps over dim 0 of each `xs` leaf, first to last, and returns `(*carry,
*ys)`. torch's `scan(combine_fn, init, xs, dim=, reverse=)` flattens the
pytrees and, before calling the operator, moves `dim` to 0 and flips `xs` for
`reverse` (flipping `ys` back after it): the operator itself has neither.

`scan(fn, init, xs)` takes `fn(carry, x) -> (carry, y)`: here the carry and `x`
are the lists of leaves, `y` the list of outputs, and the additional inputs are
arguments of a partial, where `scan` finds the tensors among them as captures
(loop inputs read afresh at each call, with gradients) and compares the rest
(torch's integer sizes) by value for its trace cache.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import weakref
from typing import Callable

import torch

from torch_xla_ext import policies
from torch_xla_ext.scan import scan
from torch_xla_ext.scan.loop import check_unroll


@dataclasses.dataclass(frozen=True)
class LoopOptions:
    """What `scan` is given besides the operator's arguments: the activation
    policy (a partitioner) and the steps per loop iteration."""
    partition_fn: Callable = policies.save_everything
    unroll: int | bool = 1

    @classmethod
    def checked(cls, partition_fn, unroll, caller: str) -> "LoopOptions":
        """The options as `caller` was given them, checked as `scan` would."""
        return cls(policies.resolve(partition_fn, caller), check_unroll(unroll, caller))


def run_as_loop(combine_fn: Callable, init, xs, additional_inputs, options: LoopOptions):
    """`scan_op(combine_fn, init, xs, additional_inputs)`'s results, `(*carry,
    *ys)`, computed by one `scan` (a While loop each way)."""
    if isinstance(combine_fn, torch.fx.GraphModule):
        combine_fn = _on_device(combine_fn, init[0].device)
    step = functools.partial(_step, combine_fn, len(init), tuple(additional_inputs))
    carry, ys = scan(step, list(init), list(xs), options.partition_fn, unroll=options.unroll)
    return (*carry, *ys)


# Per body traced on another device, its copy that makes its tensors on the
# loop's device (kept, so that `scan` finds its trace again at the next call).
_MOVED: weakref.WeakKeyDictionary[torch.fx.GraphModule, dict] = weakref.WeakKeyDictionary()


def _on_device(body: torch.fx.GraphModule, device: torch.device) -> torch.fx.GraphModule:
    """`body`, or a copy whose ops that make tensors (`arange`, `full`, the
    `scalar_tensor` of a decomposition) make them on `device`: an exported
    body was traced on the CPU, and torch_xla's lowering of an exported
    program moves the tensor factories of the top graph to XLA, not those of
    the operator's body."""
    elsewhere = [node for node in body.graph.nodes
                 if isinstance(node.kwargs.get("device"), torch.device)
                 and node.kwargs["device"] != device]
    if not elsewhere:
        return body
    copies = _MOVED.setdefault(body, {})
    if device not in copies:
        moved = copy.deepcopy(body)
        for node in moved.graph.nodes:
            if isinstance(node.kwargs.get("device"), torch.device):
                node.kwargs = {**node.kwargs, "device": device}
        moved.recompile()
        copies[device] = moved
    return copies[device]


def _step(combine_fn, carry_count: int, additional_inputs: tuple, carry: list, x: list):
    outputs = list(combine_fn(*carry, *x, *additional_inputs))
    return outputs[:carry_count], outputs[carry_count:]
