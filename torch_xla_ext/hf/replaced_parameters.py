"""The parameters `stack_layers` took the place of.

Converting copies each stacked layer's parameters into the stack's stacked
ones, and the layers' own Parameter objects leave the model. An optimizer
made before converting (as many training scripts order it) still holds
them: its steps would update tensors nothing reads and leave those layers
untrained, without a word. So each one is marked with its unconverted name
(`mark_replaced`), and every optimizer step first looks at its groups
(`refuse_replaced`, through `patches.torch.guard_optimizer_steps`): one that
holds a replaced parameter raises a ValueError naming it, before anything
is updated.
"""
from __future__ import annotations

from torch import nn

from torch_xla_ext.patches.torch import guard_optimizer_steps

__all__ = ["mark_replaced"]

# The attribute a replaced Parameter carries: its unconverted name.
_REPLACED = "_replaced_by_stack_layers"
NAMES_SHOWN = 3


def mark_replaced(model: nn.Module, lists: list[tuple[str, nn.ModuleList]]) -> None:
    """Marks the parameters of the layer lists `lists` ((path, list), as they
    were before `model` was converted) that `model` no longer holds, and
    makes every optimizer step look for them."""
    kept = {id(param) for param in model.parameters()}
    for path, layers in lists:
        for name, param in layers.named_parameters(prefix=path, remove_duplicate=False):
            if id(param) not in kept:
                setattr(param, _REPLACED, name)
    guard_optimizer_steps(refuse_replaced)


def refuse_replaced(optimizer) -> None:
    """Raises a ValueError if `optimizer` holds parameters `stack_layers` replaced."""
    names = [getattr(param, _REPLACED) for group in optimizer.param_groups
             for param in group["params"] if hasattr(param, _REPLACED)]
    if names:
        shown = ", ".join(repr(name) for name in names[:NAMES_SHOWN])
        more = f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""
        raise ValueError(
            f"{type(optimizer).__name__}.step(): {len(names)} of its parameters are the "
            f"unconverted layers' own ({shown}{more}), which stack_layers replaced by stacked "
            f"ones: this optimizer was made before converting, and its steps would leave those "
            f"layers untrained. Make the optimizer after stack_layers(model) (to keep its "
            f"state, load the state_dict() it saved into the new one: both use the "
            f"unconverted layout)")
