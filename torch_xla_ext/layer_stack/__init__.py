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
access is recorded (the trace goes on with the template's value, to be
discarded). A call runs as one scan only if its trace read none: then the traced computation cannot depend on their
values, so it is every layer's. Otherwise (a cache is passed, or the layer's computation uses
its index), and when a call argument cannot enter a traced loop (a cache
object), the call runs the layers one by one, each with its own values, which
is the loop itself, and warns with a `LayerByLayerWarning`.

A list of layers of any structure, called by its owner's own forward loop:
`StackedList`. It stores the layers in segments (`segments`: runs of layers
alike in structure, patterns that repeat, single layers), each a
`LayerStack` over its layers or groups, and looks like the `nn.ModuleList`
it replaced. Its owner's forward is hooked (`owner_loops`): at the first call of
each kind of call, the forward runs once with the layers recorded
(`dry_run`), which gives the plan of that kind of call (`planner`, data:
which layers run as which scan, which as themselves, which one by one and
why), and every call runs as its plan says (`execution`, `plan_store`), its
scans run by the call's executor (`executors`).

The modules, one job each:

* layers alike: `alike` (layouts, the check, its messages: a `Refusal`
  says why layers cannot be stacked, a value until a constructor raises it,
  as it says everywhere why a run cannot scan), `forms`
  (the comparable forms of settings), `per_layer` (per-layer attributes,
  watched while tracing), `kinds` (`PerLayerChoice`, what a layer computes);
* storage: `stack` (`LayerStack`; `checked_stack_options`: a wrong option
  is an argument error, not a refusal), `segments` (where a list splits),
  `stacked_list` (`StackedList`; `stacking_refusal`, why it would refuse a
  list, without building it), `storage` (a segment's tensors stored once,
  stacked, the layers' own Parameters views of their slices),
  `stacked_steps` (an optimizer's step of a whole stacked tensor),
  `addressed` (what code outside the forward does to a layer: a setting
  changed is read again, a layer with hooks of its own runs as itself, a
  LayerStack's items refuse hooks, edits of the list are refused),
  `names` (the one map between stored and
  per-layer names: state dicts, optimizer state), `optimizer_state`
  (optimizer state dicts saved and loaded in the unconverted layout);
* calls: `owner_loops` (the owner's hooks, `LayerCall`), `fakes` (stand-ins for
  running a layer on no data), `dry_run`, `planner`, `plan_store`,
  `execution`, `executors` (how the call's scans run: the lazy XLA loop,
  torch's scan operator under `torch.export`, Dynamo's trace; chosen once,
  from torch's flags, in `executor_of_call`), `shared_mappings` (a mapping every layer call gets, whose
  entries layers write and read), `layer_state` (attributes a layer sets on
  its own modules, kept per layer); `scan_runner` (one scan over stacked tensors,
  `lower`, the layer-by-layer loop), `operands` (a call's arguments as the
  scan's operands), `dynamo` (under
  Dynamo, with `trace_loops_in_dynamo`: the loop as torch's scan operator,
  what the forward reads of its items, `GraphBreakWarning`), `hooks` (the
  layers' forward hooks, replayed after the scan, with the for loop's
  gradients for what they got), `layer_list` (`scan_layers`), `sharding` (FSDPv2: stacked
  weights and the hidden state a scan carries).
"""
from torch_xla_ext.diagnostics import Refusal
from torch_xla_ext.layer_stack.execution import ScanResult, scan_result
from torch_xla_ext.layer_stack.executors import ExportWarning, device_reason
from torch_xla_ext.layer_stack.kinds import PerLayerChoice
from torch_xla_ext.layer_stack.layer_list import scan_layers
from torch_xla_ext.layer_stack.owner_loops import drive_loops, loop_names, undrive_loops
from torch_xla_ext.layer_stack.per_layer import DEFAULT_PER_LAYER_ATTRIBUTES, OpaqueValue
from torch_xla_ext.layer_stack.plan_store import OwnerPlans
from torch_xla_ext.layer_stack.scan_runner import (
    LayerByLayerWarning, Layers, Recording, attempt, attempt_recording, warn_layer_by_layer)
from torch_xla_ext.layer_stack.sharding import ShardingWarning
from torch_xla_ext.layer_stack.stack import LayerStack, checked_stack_options
from torch_xla_ext.layer_stack.stacked_list import (
    LayerGroup, SegmentStack, StackedList, stacking_refusal)
from torch_xla_ext.layer_stack.dynamo import GraphBreakWarning, trace_loops_in_dynamo

__all__ = ["DEFAULT_PER_LAYER_ATTRIBUTES", "ExportWarning", "GraphBreakWarning",
           "LayerByLayerWarning", "LayerGroup", "LayerStack", "Layers", "OpaqueValue", "OwnerPlans",
           "PerLayerChoice", "Recording", "Refusal", "ScanResult",
           "SegmentStack",
           "ShardingWarning", "StackedList", "attempt", "attempt_recording",
           "checked_stack_options", "device_reason", "drive_loops", "loop_names",
           "scan_layers", "scan_result", "stacking_refusal", "trace_loops_in_dynamo",
           "undrive_loops", "warn_layer_by_layer"]
