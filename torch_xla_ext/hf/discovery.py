"""Finding a transformers model's layer lists, and what keeps one from
being stacked.

A layer list is an `nn.ModuleList` of blocks: modules made of modules (an
attention and an MLP, a mixer and a norm, held directly or in a list of
the block's parts, T5's), not of single linear or
embedding layers, and not inside a block of another such list (a
mixture-of-experts layer's experts). Which lists the model's forward calls
as a chain of layers, and how, is found at its calls (`layer_stack.plan_store`);
a list whose layers are not called as a chain runs them as themselves.
Nothing here reads a model's code or names its classes.

What keeps a list from being stacked is decided here, once, as a value
(`Unstackable`) before any stack is built: gradient checkpointing enabled
on some layers only (a scan
recomputes every layer or none), and what a `StackedList` refuses
(`layer_stack.stacking_refusal`: layers not alike where they are stored
together, a parameter shared between them, a setting that reaches the
layer's own modules through what copies share).
"""
from __future__ import annotations

import dataclasses

from torch import nn

from torch_xla_ext.layer_stack import StackedList, stacking_refusal
from torch_xla_ext.diagnostics import TorchXlaExtWarning

__all__ = ["LayerList", "Unstackable", "UnstackedLayersWarning", "checkpointing_reason",
           "is_capture_hook", "layer_list", "layer_list_paths", "output_recorder",
           "recorded_outputs", "submodule"]

# transformers' own output-capturing hooks, which a stack replays after its scan.
_TRANSFORMERS_CAPTURE_HOOKS = "transformers.utils.output_capturing"


class UnstackedLayersWarning(TorchXlaExtWarning):
    """stack_layers(model) without a path left one of the model's layer lists
    as it was (its layers run one by one, as before) while stacking the
    others; the message names the list and says why."""


@dataclasses.dataclass(frozen=True)
class LayerList:
    """A layer list that stack_layers can stack, and what the stack needs."""
    path: str
    owner: nn.Module  # whose attribute `name` the list is
    name: str
    layers: nn.ModuleList
    config: object
    recorder: nn.Module | None  # see output_recorder


@dataclasses.dataclass(frozen=True)
class Unstackable:
    """A layer list that stack_layers cannot stack, and why."""
    path: str
    reason: str
    error: type[Exception] = ValueError


def submodule(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"stack_layers: {type(model).__name__} has no submodule {path!r}; "
                         f"pass path as the dotted name of its decoder-layer nn.ModuleList, "
                         f"such as 'model.layers'.") from None


def layer_list_paths(model: nn.Module) -> list[str]:
    """The paths of the model's layer lists (see the module docstring), and
    of the stacks made of them."""
    found = []
    for path, module in model.named_modules():
        if any(path.startswith(outer + ".") for outer in found):
            continue  # inside a layer (or a stack) of a list found already
        if isinstance(module, StackedList) or (
                isinstance(module, nn.ModuleList) and len(module)
                and all(_is_block(layer) for layer in module)):
            found.append(path)
    if not found:
        raise ValueError(
            f"stack_layers: found no layer list in {type(model).__name__} (no nn.ModuleList "
            f"of blocks, modules made of modules); pass path='...' naming its decoder-layer "
            f"nn.ModuleList.")
    return found


def _is_block(module: nn.Module) -> bool:
    """A module made of at least two modules that hold tensors of their own;
    the modules of a list or dict among its children count as its own (T5's
    block keeps its attention and feed-forward parts in an nn.ModuleList)."""
    parts = [part for child in module.children()
             for part in (child.children() if isinstance(child, (nn.ModuleList, nn.ModuleDict))
                          else [child])]
    return sum(1 for part in parts
               if any(True for _ in part.parameters()) or any(True for _ in part.buffers())) >= 2


def layer_list(model: nn.Module, path: str, options: dict) -> LayerList | Unstackable | None:
    """The list at `path` to stack with `options` (the stacks' options,
    checked already), why it cannot be stacked, or None when it is stacked
    already."""
    layers = submodule(model, path)
    if isinstance(layers, StackedList):
        return None
    if not isinstance(layers, nn.ModuleList):
        return Unstackable(path, f"{path!r} is a {type(layers).__name__}, not the "
                                 f"nn.ModuleList of decoder layers; pass the path of that list",
                           TypeError)
    parent_path, _, name = path.rpartition(".")
    owner = model.get_submodule(parent_path)
    config = getattr(owner, "config", getattr(model, "config", None))
    reason = checkpointing_reason(layers, path)
    if reason is not None:
        return Unstackable(path, reason)
    refusal = stacking_refusal(layers, **options)
    if refusal is not None:
        return Unstackable(path, refusal.reason, refusal.error)
    return LayerList(path, owner, name, layers, config, output_recorder(model, path))


def is_capture_hook(hook) -> bool:
    """Whether `hook` is one of transformers' output-capturing hooks, which
    the stacks replay after their scans; a layer with any other hook runs as
    itself (`layer_stack.StackedList.replays_hook`)."""
    return getattr(hook, "__module__", None) == _TRANSFORMERS_CAPTURE_HOOKS


def checkpointing_reason(layers: nn.ModuleList, path: str) -> str | None:
    """Why not, unless gradient checkpointing is enabled on every layer or on
    none (the scan recomputes every layer, or none)."""
    enabled = [index for index, layer in enumerate(layers)
               if any(getattr(module, "gradient_checkpointing", False) is True
                      for module in layer.modules())]
    if enabled and len(enabled) != len(layers):
        return (f"gradient checkpointing is enabled on the layers {enabled} of {path!r} only, "
                f"of {len(layers)} (activation_checkpointing_enable(every_n_layers=...)?); the "
                f"stacked layers run as one scan, which recomputes every layer in its backward "
                f"loop or none. Enable it for every layer (every_n_layers=1) or disable it first")
    return None


def output_recorder(model: nn.Module, path: str) -> nn.Module | None:
    """The model whose output-capturing hooks collect per-layer outputs from
    the layers at `path` (`output_hidden_states`, ...): the innermost module
    holding them that names what it records (`_can_record_outputs`; a vision
    tower's, not its encoder's, which holds the list), or None."""
    parts = path.split(".")
    for end in range(len(parts) - 1, -1, -1):
        module = model.get_submodule(".".join(parts[:end]))
        if getattr(module, "_can_record_outputs", None):
            return module
    return None


def recorded_outputs(recorder: nn.Module | None) -> tuple[str, ...]:
    """What transformers collects from every layer with its output-capturing
    hooks: the keys of the recorder's `_can_record_outputs`."""
    return tuple(getattr(recorder, "_can_record_outputs", None) or {})
