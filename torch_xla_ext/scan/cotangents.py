"""The gradient each step's `y` values get inside their step (`StepCotangents`).

A scan's `ys` are outputs: the gradient that reaches a slice of them is what
the caller's own uses of it give, as with `jax.lax.scan`. A caller whose ys
are values its steps also use (the hidden states and attention weights a
stack's hooks record, which the layer's later ops and the next layers read)
may want what a for loop gives them instead: the whole gradient of each such
value. With `StepCotangents`, the training loops are built so that the
backward loop can also stack, per step and stacked y, the cotangent the rest
of its step gives the y; the backward runs that loop only when the request's
`wanted()` says so, and hands what it stacked to `receive`.

How the differentiated step (`AOTAutograd`'s) finds those cotangents: each
floating y that requires grad gets a tensor hook, which sees the y's whole
cotangent, and the step's differentiable inputs pass through `_Sink`, an
identity whose backward runs after every such hook (all of the step is
computed from its outputs). Its backward gives each hook's cotangent as the
gradient of an extra input, a "sink" per stacked y that the step never
reads, so that the backward graph outputs them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class StepCotangents:
    """Asks a training scan for the cotangent each step's stacked `y` values
    get from the rest of their step, beyond what reaches them through `ys`.

    `wanted()` is asked when the backward runs; if True, the backward loop
    also stacks those cotangents, and `receive` gets them as a tree of the
    `ys`' structure: per y leaf a tensor `[length, ...]`, or None for a y that
    is not floating, does not require grad in the step, or is an `xs` slice
    returned unchanged. A nested scan warns that it has no effect (its
    backward is part of the outer step's)."""
    wanted: Callable[[], bool]
    receive: Callable[[Any], None]


class Taps:
    """The sinks of one differentiated step: one per tapped y, in order."""

    def __init__(self, y_avals: Sequence, stacked_y: Sequence[int]):
        # A y is tapped where the loop stacks it and it is floating: its
        # index among the ys, and among the loop's stacked outputs.
        tapped = [(i, position) for position, i in enumerate(stacked_y)
                  if y_avals[i].dtype.is_floating_point]
        self.y_indices = [i for i, _ in tapped]
        self.positions = [position for _, position in tapped]
        self.sink_avals = [y_avals[i]._replace(requires_grad=True) for i in self.y_indices]
        self._seen: list = []

    def enter(self, inputs: Sequence[torch.Tensor], sinks: Sequence[torch.Tensor]) -> list:
        """The step's inputs as it should read them: those that require grad
        through `_Sink`, with the sinks."""
        self._seen = [None] * len(sinks)
        flowing = [i for i, t in enumerate(inputs) if t.requires_grad]
        passed = _Sink.apply(self, len(flowing), *[inputs[i] for i in flowing], *sinks)
        inputs = list(inputs)
        for i, tensor in zip(flowing, passed):
            inputs[i] = tensor
        return inputs

    def watch(self, y_out: Sequence[torch.Tensor]) -> None:
        """Hooks the tapped ys the step returned (before any copy of them)."""
        for sink, index in enumerate(self.y_indices):
            y = y_out[index]
            if y.requires_grad:
                y.register_hook(lambda grad, sink=sink: self._see(sink, grad))

    def _see(self, sink: int, grad: torch.Tensor) -> None:
        self._seen[sink] = grad

    def seen(self) -> list:
        return self._seen


class _Sink(torch.autograd.Function):
    """Identity on the step's differentiable inputs; its backward, the last
    of the step's, gives the taps' cotangents as the sinks' gradients."""

    @staticmethod
    def forward(ctx, taps: Taps, count: int, *tensors):
        ctx.taps, ctx.count = taps, count
        return tuple(t.view_as(t) for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *grads, *ctx.taps.seen())
