"""Run a stack of structurally identical layers as one `scan`.

`LayerStack` keeps each parameter and buffer of its layers once, stacked along
a new leading layer dimension, and hands those stacked tensors to `scan` as
`xs`. Each loop iteration slices one layer's weights out inside the XLA While
loop, so neither the forward nor the backward copies the weights, and the
gradients land in the stacked parameters' `.grad`.

`scan_layers` is the drop-in for `torch_xla.experimental.scan_layers.scan_layers`
(and for `for layer in layers: x = layer(x)`) on layers kept in a list: it
stacks their tensors at every call, which copies them, then runs the same scan.

Both trace one layer (the template) once per combination of layer settings and
call arguments, and run its code for every layer; so they first check that
every layer has the template's structure, tensor shapes and settings.

When two layers' settings are the same. Every attribute of every submodule
(other than nn.Module's own bookkeeping) must compare equal by value:
numbers, strings and the like by type and value; tuples, lists, dicts and plain
objects (a transformers config) item by item; functions by their code and
what they close over and default to; partials by their function and
arguments; bound methods by their function and the settings of their `self`;
the layer's own submodules, parameters and buffers by their place in the
layer. What cannot be compared by value (a tensor or module held outside the
layer's registries, an object without attributes) must be the very same
object in every layer. A setting that differs only in strings naming its own
module in the model ('model.layers.3.self_attn.q_proj' in layer 3: peft keeps
one per adapted module) is a per-layer attribute (below): it tells the
modules apart rather than configuring them. A layer that differs is refused with an error naming it
and the attribute, since the stack would otherwise silently compute something
else than the loop.

Per-layer attributes. Attributes named in `per_layer_attributes` (by default
`layer_idx`, which transformers' attention layers use only to pick their slot
in a key/value cache) may differ between layers, and each layer keeps its own
value. While the template is traced, reading one of them through attribute
access is recorded and abandons the trace. A call runs as one scan only if
its trace read none: then the traced computation cannot depend on their
values, so it is every layer's. Otherwise (a cache is passed, or the layer's computation uses
its index), and when a call argument cannot enter a traced loop (a cache
object), the call runs the layers one by one, each with its own values, which
is the loop itself, and warns with a `LayerByLayerWarning`.

The modules, one job each: `alike` (layer layouts and the check that layers
are alike, with its messages; `forms` holds the comparable forms it uses),
`per_layer` (watching per-layer attributes), `running` (running a stack as one
scan, lowering it, and the layer-by-layer fallback), `hooks` (the layers'
forward hooks, run once per layer after the scan), `stack` (`LayerStack` and
its state_dict mapping), `layer_list` (`scan_layers`), `kinds` (layers of
several kinds as one scan, each given its kind's arguments), `groups` (layers
of kinds that differ in more: a `LayerStack` per segment of their pattern),
`optimizer_state` (optimizer state dicts of stacked parameters saved and
loaded in the unconverted layout, so they move between the two), `sharding`
(FSDPv2's sharding of stacked parameters, never along the layer dimension).
"""
from torch_xla_ext.layer_stack.execution import ScanResult
from torch_xla_ext.layer_stack.kinds import PerLayerChoice, is_choice
from torch_xla_ext.layer_stack.layer_list import scan_layers
from torch_xla_ext.layer_stack.loops import drive_loops, loop_names, undrive_loops
from torch_xla_ext.layer_stack.per_layer import DEFAULT_PER_LAYER_ATTRIBUTES
from torch_xla_ext.layer_stack.plans import OwnerPlans
from torch_xla_ext.layer_stack.running import (
    LayerByLayerWarning, Layers, Recording, attempt, attempt_recording, device_reason,
    warn_layer_by_layer)
from torch_xla_ext.layer_stack.sharding import ShardingWarning
from torch_xla_ext.layer_stack.stack import LayerStack
from torch_xla_ext.layer_stack.stacked_list import (
    LayerGroup, SegmentStack, StackedList, scan_result)

__all__ = ["DEFAULT_PER_LAYER_ATTRIBUTES", "LayerByLayerWarning", "LayerGroup", "LayerStack",
           "Layers", "OwnerPlans", "PerLayerChoice", "Recording", "ScanResult",
           "SegmentStack", "ShardingWarning", "StackedList", "attempt", "attempt_recording", "device_reason",
           "drive_loops", "is_choice", "loop_names", "scan_layers", "scan_result", "undrive_loops",
           "warn_layer_by_layer"]
