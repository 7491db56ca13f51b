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

import functools

from torch_xla_ext.layer_stack import LayerStack
from torch_xla_ext.on_import import when_imported


def teach_class_lookup() -> None:
    """Teaches transformers' class lookup (above), once per process."""
    when_imported("transformers.trainer_pt_utils", _teach)


def _teach() -> None:
    import transformers.trainer_pt_utils as trainer_utils

    lookup = trainer_utils.get_module_class_from_name

    # transformers' lookup recurses through this module global, so each
    # submodule it visits, a stack among them, passes here.
    @functools.wraps(lookup)
    def get_module_class_from_name(module, name):
        if isinstance(module, LayerStack) and module.template is not None:
            found = lookup(module.template, name)
            if found is not None:
                return found
        return lookup(module, name)

    trainer_utils.get_module_class_from_name = get_module_class_from_name
