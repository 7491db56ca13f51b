"""`scan_layers`: layers kept in a list, their tensors stacked at every call."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from torch_xla_ext.layer_stack import scan_runner
from torch_xla_ext.layer_stack.alike import Refusal, identical_layers, layer_tensors
from torch_xla_ext.layer_stack.per_layer import DEFAULT_PER_LAYER_ATTRIBUTES
from torch_xla_ext.policies import save_everything
from torch_xla_ext.scan.mutation import Writes


def scan_layers(layers: Iterable[nn.Module], input_data, partition_fn=save_everything,
                is_layer_pure=None, *,
                per_layer_attributes: Iterable[str] = DEFAULT_PER_LAYER_ATTRIBUTES):
    """Runs `layers` in sequence on `input_data` as one scan; returns the last output.

    A drop-in for `torch_xla.experimental.scan_layers.scan_layers`, equivalent to

        for layer in layers:
            input_data = layer(*input_data) if isinstance(input_data, tuple) else layer(input_data)

    a tuple is passed as the layer's positional arguments, and a layer's whole
    output is the next layer's input (so it must have the input's structure,
    shapes and dtypes). The layers must be alike (see the package docstring);
    attributes named in `per_layer_attributes` may differ. `partition_fn` (a
    policy of `torch_xla_ext.policies` or its name, or an AOTAutograd
    partitioner) and `is_layer_pure` go to `scan` as `partition_fn` and
    `is_fn_pure` (None, the default, caches the trace as for a pure layer;
    False traces at every call, as torch_xla's default does).

    This stacks the layers' tensors at every call, a copy of all the weights
    that the backward pass flows through too; keep the layers in a `LayerStack`
    to avoid it.
    """
    layers = list(layers)
    if not layers:
        return input_data
    alike = identical_layers(layers, frozenset(per_layer_attributes))
    if isinstance(alike, Refusal):
        raise alike.exception()
    layout, per_layer_values, _ = alike
    per_layer = [layer_tensors(layer, layout.tensors) for layer in layers]
    stacked = {name: torch.stack([tensors[name] for tensors in per_layer])
               for name in layout.tensors}
    buffers = {name: stacked[name] for name, spec in layout.tensors.items()
               if not spec.is_parameter}
    writes = Writes(buffers.values())
    output = scan_runner.run(
        scan_runner.Layers(layers[0], layout, stacked, per_layer_paths=tuple(per_layer_values),
                       layer_at=layers.__getitem__, num_layers=len(layers), drop_in=True,
                       partition_fn=partition_fn, is_layer_pure=is_layer_pure, unroll=1),
        input_data, (), {})
    _write_back_buffers(layers, buffers, writes)
    return output


def _write_back_buffers(layers: list, stacked_buffers: dict, writes: Writes) -> None:
    """Gives each layer its slice of the stacked buffer copies that the scan
    wrote (as the layers' in-place updates, BatchNorm's running statistics)."""
    with torch.no_grad():
        for name, stacked in stacked_buffers.items():
            if writes.written(stacked):
                for index, layer in enumerate(layers):
                    layer.get_buffer(name).copy_(stacked[index])
