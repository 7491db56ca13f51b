"""Reading a transformers model before its layers are stacked: where its
decoder-layer list is, how its forward calls the layers (a slice of them, or
an iteration that does nothing else between two layers), their kinds
(`config.layer_types`), and what a scan could not run (hooks, gradient
checkpointing on some layers only)."""
from __future__ import annotations

import ast
import inspect
import re
import textwrap

from torch import nn

from torch_xla_ext.hf.stacks import STACKS, StackedLayerKinds, StackedLayers


# transformers' own output-capturing hooks, which a StackedLayers replays after its scan.
_TRANSFORMERS_CAPTURE_HOOKS = "transformers.utils.output_capturing"


def submodule(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"stack_layers: {type(model).__name__} has no submodule {path!r}; "
                         f"pass path as the dotted name of its decoder-layer nn.ModuleList, "
                         f"such as 'model.layers'.") from None


def layers_path(model: nn.Module) -> str:
    """The path of the model's one nn.ModuleList of decoder layers."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    found = [name for name, module in model.named_modules()
             if isinstance(module, (nn.ModuleList, *STACKS)) and len(module)
             and _one_class_among(module, layer_classes)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValueError(
            f"stack_layers: found no decoder-layer nn.ModuleList in {type(model).__name__} "
            f"(none holds layers of the classes it names in _no_split_modules: "
            f"{sorted(layer_classes)}); pass path='...' naming it.")
    raise ValueError(f"stack_layers: {type(model).__name__} has several lists of decoder "
                     f"layers: {found}; pass path='...' naming the one to stack.")


def _one_class_among(layers: nn.Module, class_names: set) -> bool:
    if isinstance(layers, StackedLayers):
        return type(layers._template).__name__ in class_names
    if isinstance(layers, StackedLayerKinds):
        return type(layers.segments[0]._template.layers[0]).__name__ in class_names
    classes = {type(layer) for layer in layers}
    return len(classes) == 1 and next(iter(classes)).__name__ in class_names


def layer_loop(owner: nn.Module, name: str, path: str) -> tuple[str, int] | None:
    """How the owner's forward calls the layers: None when it takes them as a
    slice (`for layer in self.layers[: n]`), which yields the stack itself; or
    (file, first line) of the forward when it iterates over them (`for block in
    self.h`, `enumerate(self.h)`) with a loop body that only calls the layer on
    the hidden state, for StackedLayers.__iter__ to recognize. Raises
    ValueError naming the line of a loop that does more between the layers."""
    forward = inspect.unwrap(type(owner).forward)
    try:
        lines, first_line = inspect.getsourcelines(forward)
    except (OSError, TypeError):
        lines, first_line = [], 0
    source = textwrap.dedent("".join(lines))
    if re.search(rf"self\.{re.escape(name)}\s*\[", source):
        return None
    where = type(owner).__qualname__ + ".forward"
    loop = next((node for node in ast.walk(ast.parse(source)) if source and
                 isinstance(node, ast.For) and _iterates_over(node.iter, name)), None)
    if loop is None:
        raise ValueError(
            f"stack_layers: {where} neither loops over a slice `self.{name}[...]` nor over "
            f"`self.{name}` itself (or its source is not available), so it would call the "
            f"layers at {path!r} one by one, not as one scan. stack_layers takes over loops of "
            f"the form `for layer in self.{name}[: n]` or `for layer in self.{name}`; for "
            f"other models, call a torch_xla_ext.LayerStack from your own forward.")
    layer = loop.target.elts[-1] if isinstance(loop.target, ast.Tuple) else loop.target
    body = loop.body
    calls = [each for each in body if _only_calls_the_layer(each, layer)]
    extra = [each for each in body if len(calls) != 1
             or not (each is calls[0] or _only_looks_up(each, calls[0]))]
    if extra:
        statement = extra[0]
        line = first_line + statement.lineno - 1
        text = source.splitlines()[statement.lineno - 1].strip()
        raise ValueError(
            f"stack_layers: {where} does more between two layers than call the next one on "
            f"the hidden state ({forward.__code__.co_filename}:{line}: `{text}`); one scan "
            f"runs all the layers at once, so that work would not run between them. Move it "
            f"before or after the loop, or call a torch_xla_ext.LayerStack from your own "
            f"forward; the model is unchanged.")
    return forward.__code__.co_filename, forward.__code__.co_firstlineno


def _iterates_over(iterable: ast.expr, name: str) -> bool:
    """`self.name`, or `enumerate(self.name)`."""
    if (isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name)
            and iterable.func.id == "enumerate" and iterable.args):
        iterable = iterable.args[0]
    return (isinstance(iterable, ast.Attribute) and iterable.attr == name
            and isinstance(iterable.value, ast.Name) and iterable.value.id == "self")


def _only_looks_up(statement: ast.stmt, call: ast.Assign) -> bool:
    """`name = <an expression without calls>` (Exaone4's `layer_type =
    self.config.layer_types[i]`), naming neither the hidden state nor anything
    the layer call's result replaces: it cannot change what the layers compute."""
    hidden = call.targets[0].id
    return (isinstance(statement, ast.Assign)
            and all(isinstance(target, ast.Name) and target.id != hidden
                    for target in statement.targets)
            and not any(isinstance(node, ast.Call) for node in ast.walk(statement.value)))


def _only_calls_the_layer(statement: ast.stmt, layer: ast.expr) -> bool:
    """`hidden = layer(hidden, ...)`: the layer called on what the result replaces."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name) and isinstance(layer, ast.Name)):
        return False
    call = statement.value
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            and call.func.id == layer.id and bool(call.args)
            and isinstance(call.args[0], ast.Name) and call.args[0].id == statement.targets[0].id)


def mixed_layer_types(config, count: int) -> list | None:
    """transformers configs list per-layer kinds (full or sliding attention) in
    `layer_types`, and the forward passes each layer the mask of its kind:
    the kinds when they are not all the same, else None."""
    layer_types = list(getattr(config, "layer_types", None) or ())[:count]
    if len(set(layer_types)) < 2:
        return None
    if len(layer_types) < count:
        raise ValueError(
            f"stack_layers: config.layer_types lists {len(layer_types)} kinds for {count} "
            f"layers; give every layer its kind (or one kind for all). The model is unchanged.")
    return layer_types


def check_no_hooks(layer: nn.Module, path: str) -> None:
    for module_path, module in layer.named_modules():
        where = f"{path}.{module_path}" if module_path else path
        for registry in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                         "_backward_hooks"):
            for hook in getattr(module, registry).values():
                if getattr(hook, "__module__", None) == _TRANSFORMERS_CAPTURE_HOOKS:
                    continue
                raise ValueError(
                    f"stack_layers: {where} has a hook in {registry} "
                    f"({getattr(hook, '__qualname__', hook)!r}); the stacked layers run inside "
                    f"one scan, where hooks of the layers would not run. Remove it first; the "
                    f"model is unchanged.")


def check_checkpointing_alike(layers: nn.ModuleList, path: str) -> None:
    """Raises unless gradient checkpointing is enabled on every layer or on
    none (the scan recomputes every layer, or none)."""
    enabled = [index for index, layer in enumerate(layers)
               if any(getattr(module, "gradient_checkpointing", False) is True
                      for module in layer.modules())]
    if enabled and len(enabled) != len(layers):
        raise ValueError(
            f"stack_layers: gradient checkpointing is enabled on the layers {enabled} of "
            f"{path!r} only, of {len(layers)} (activation_checkpointing_enable(every_n_layers="
            f"...)?); the stacked layers run as one scan, which recomputes every layer in its "
            f"backward loop or none. Enable it for every layer (every_n_layers=1) or disable it "
            f"first; the model is unchanged.")


def recorded_outputs(owner: nn.Module) -> tuple[str, ...]:
    """What transformers collects from every layer with its output-capturing
    hooks (`output_hidden_states`, ...): the keys of the model's `_can_record_outputs`."""
    return tuple(getattr(owner, "_can_record_outputs", None) or {})
