"""transformers' FSDP wrapping (`wrap_model_xla_fsdp`, what `Trainer` does
with `fsdp_config={"xla": True, "xla_fsdp_v2": True,
"transformer_layer_cls_to_wrap": [...]}`) of a model whose layers
stack_layers stacked.

transformers finds each class named in `transformer_layer_cls_to_wrap` by
walking the model's modules (`get_module_class_from_name`) and raises if it
is not there; a stack keeps its layers' modules in its template, out of that
walk. So the first `stack_layers` call teaches the lookup (at once if
transformers' Trainer utilities are imported, else when they are: they take
seconds) to search a stack's template where it meets the stack. The layers
stay stacked in their place, so no module of that class is wrapped as a
unit of its own: the stack runs them as one scan, and the wrapper around
the model holds their stacked weights. What a unit per layer would add the
stack does itself (`torch_xla_ext.layer_stack.sharding`): FSDPv2 shards
each stacked weight as it would one layer's, never along the layer
dimension; each layer's output is sharded on the batch, as a unit's output,
inside the scan; and each layer's backward is one iteration of a loop,
which no fusion crosses, as a unit's optimization barrier makes it.
"""
from __future__ import annotations

from torch_xla_ext.layer_stack import LayerStack
from torch_xla_ext.patches.transformers import search_class_lookup


def teach_class_lookup() -> None:
    """Teaches transformers' class lookup (above), once per process, through
    `torch_xla_ext.patches.transformers` (`unstack_layers` undoes it)."""
    search_class_lookup(_template)


def _template(module):
    """Where the lookup searches first: a stack's template layer."""
    return module.template if isinstance(module, LayerStack) else None
