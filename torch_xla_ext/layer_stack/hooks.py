"""Forward hooks of a stack's layers, run as if each layer had been called.

A scan's step is traced once and then run from its cache, so a hook that ran
inside it would run once per trace, on the trace's stand-in tensors, never
once per call and layer. Instead, while the step is traced, the template's
hooked modules do not run their hooks but record their calls
(`hooks_held`): the positional arguments and the output of each, which the
step returns among its `ys`, so that the scan stacks them along the layers.
After the loop, `replay` runs each hook once per layer on that layer's slice
of them: layer after layer and, within a layer, in the order the calls ended,
which is the order the hooks run in the for loop. (transformers collects
`output_hidden_states` and `output_attentions` with such hooks.) Their
gradients are the for loop's too: `RetainedGradients`.
"""
from __future__ import annotations

import collections
import contextlib
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten


def hooked_modules(template: nn.Module) -> dict[str, nn.Module]:
    """The template's modules that have forward hooks, by path."""
    return {path: module for path, module in template.named_modules()
            if module._forward_hooks}


def unreplayable(template: nn.Module) -> str | None:
    """Why the template's forward hooks cannot be replayed after the loop, or None."""
    for path, module in hooked_modules(template).items():
        if set(module._forward_hooks) & set(module._forward_hooks_with_kwargs):
            return (f"a forward hook of {path or 'the layer'} takes the call's keyword "
                    f"arguments, which the scan does not keep for it")
    return None


@contextlib.contextmanager
def hooks_held(template: nn.Module, calls: list | None = None):
    """While the block runs, no forward hook of `template` or its submodules
    runs; with `calls`, each call of a hooked module appends `{path: (args,
    output)}` to it when the call ends, as the hooks would have seen them."""
    held = hooked_modules(template)
    saved = {path: module._forward_hooks for path, module in held.items()}

    def recorder(path: str):
        def record(module, args, output):
            calls.append({path: (args, output)})
        return record

    try:
        for path, module in held.items():
            module._forward_hooks = collections.OrderedDict()
            if calls is not None:
                module.register_forward_hook(recorder(path))
        yield
    finally:
        for path, module in held.items():
            module._forward_hooks = saved[path]


def replay(template: nn.Module, calls: list, num_layers: int,
           retained: RetainedGradients) -> None:
    """Runs the forward hooks of the template's modules once per layer, on
    that layer's slice of `calls` (what `hooks_held` recorded in the step,
    each tensor stacked along the layers by the scan); `retained` watches the
    slices for `retain_grad()`."""
    leaves, spec = tree_flatten(calls)
    per_layer = [[None] * num_layers if leaf is None else leaf.unbind(0) for leaf in leaves]
    for index in range(num_layers):
        for call in tree_unflatten([slices[index] for slices in per_layer], spec):
            (path, (args, output)), = call.items()
            module = template.get_submodule(path)
            for hook in list(module._forward_hooks.values()):
                if hook(module, args, output) is not None:
                    raise TypeError(
                        f"a forward hook of {path or 'the layer'} ({hook!r}) returned a new "
                        f"output; a stack replays its layers' hooks after the scan, where "
                        f"they can observe each layer's output but not replace it. Remove "
                        f"the hook or run the layers unstacked.")
    retained.watch(leaves, per_layer)


class RetainedGradients:
    """The slices of the recorded calls that the hooks got, whose gradient a
    caller may retain (`retain_grad()` on a hidden state or attention weights
    that transformers collected). A slice is a view of the scan's stacked
    outputs, which no later layer reads: what reaches it is only its own uses'
    gradient. The rest, what its layer and the layers after it gave the value
    in the for loop, the scan's backward gives for the steps' recorded values
    when `wanted` (`scan.StepCotangents`), and `receive` adds it to the
    retained gradients, as the for loop's would be."""

    def __init__(self):
        self._slices: list = []  # (leaf number, layer, weak reference to the slice)

    def watch(self, leaves: list, per_layer: list) -> None:
        self._slices = [(number, index, weakref.ref(piece))
                        for number, (leaf, pieces) in enumerate(zip(leaves, per_layer))
                        if isinstance(leaf, torch.Tensor) and leaf.requires_grad
                        for index, piece in enumerate(pieces)]

    def _retained(self) -> list:
        return [(number, index, piece) for number, index, ref in self._slices
                if (piece := ref()) is not None and piece.retains_grad]

    def wanted(self) -> bool:
        return bool(self._retained())

    def receive(self, calls_cotangents) -> None:
        """Adds to each retained slice its layer's cotangent of it from the
        step (`calls_cotangents`: the recorded calls' structure, each leaf
        stacked along the layers, or None)."""
        stacked = tree_flatten(calls_cotangents)[0]
        for number, index, piece in self._retained():
            if stacked[number] is not None:
                from_step = stacked[number][index]
                piece.grad = from_step if piece.grad is None else piece.grad + from_step
