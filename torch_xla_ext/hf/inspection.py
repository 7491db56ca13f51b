"""Reading a transformers model before its layers are stacked: where its
layer lists are, how its forward calls the layers (a slice of them, or
an iteration that does nothing else between two layers), their kinds
(`config.layer_types`), and what a scan could not run (hooks, gradient
checkpointing on some layers only). `layer_list` decides, for one list,
whether it can be stacked: a `LayerList` to stack, or an `Unstackable` saying
why not.

This is the one module that reads a model's code (`layer_loop`: its
forward's source): a scan stands for the model's loop over the layers only
if that loop does nothing between two layers but call the next one, which
nothing but the loop's code shows. Once it is read, nothing is inspected
at run time: the stack learns that the loop runs from hooks on the owner
(`stacks.ForwardLoop`)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from typing import Iterable

from torch import nn

from torch_xla_ext.hf.stacks import (
    STACKS, LoopGuard, StackedAfterFirst, StackedLayerKinds, StackedLayers)
from torch_xla_ext.layer_stack.alike import layers_difference


# transformers' own output-capturing hooks, which a StackedLayers replays after its scan.
_TRANSFORMERS_CAPTURE_HOOKS = "transformers.utils.output_capturing"


def submodule(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"stack_layers: {type(model).__name__} has no submodule {path!r}; "
                         f"pass path as the dotted name of its decoder-layer nn.ModuleList, "
                         f"such as 'model.layers'.") from None


class UnstackedLayersWarning(UserWarning):
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
    kinds: list | None  # config.layer_types, when they are not all the same
    loop: LoopShape  # how the owner's forward calls it
    recorder: nn.Module | None  # see output_recorder


@dataclasses.dataclass(frozen=True)
class Unstackable:
    """A layer list that stack_layers cannot stack, and why."""
    path: str
    reason: str
    error: type[Exception] = ValueError


def layer_list_paths(model: nn.Module) -> list[str]:
    """The paths of the model's layer lists: each nn.ModuleList (or stack made
    of one) whose layers are all of one class the model names in
    `_no_split_modules` (transformers' decoder, encoder and vision layers)."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    found = [name for name, module in model.named_modules()
             if isinstance(module, (nn.ModuleList, *STACKS)) and len(module)
             and _one_class_among(module, layer_classes)]
    if not found:
        raise ValueError(
            f"stack_layers: found no decoder-layer nn.ModuleList in {type(model).__name__} "
            f"(none holds layers of the classes it names in _no_split_modules: "
            f"{sorted(layer_classes)}); pass path='...' naming it.")
    return found


def layer_list(model: nn.Module, path: str, per_layer_attributes: Iterable[str]
               ) -> LayerList | Unstackable | None:
    """The list at `path` to stack, why it cannot be stacked, or None when it
    is stacked already. `per_layer_attributes`: the settings each layer keeps
    its own of (`LayerStack`'s)."""
    layers = submodule(model, path)
    if isinstance(layers, STACKS):
        return None
    if not isinstance(layers, nn.ModuleList):
        return Unstackable(path, f"{path!r} is a {type(layers).__name__}, not the "
                                 f"nn.ModuleList of decoder layers; pass the path of that list",
                           TypeError)
    parent_path, _, name = path.rpartition(".")
    owner = model.get_submodule(parent_path)
    config = getattr(owner, "config", getattr(model, "config", None))
    loop, reason = layer_loop(owner, name, path)
    reason = (reason or _kinds_reason(config, len(layers))
              or next(filter(None, (hooks_reason(layer, f"{path}.{index}")
                                    for index, layer in enumerate(layers))), None)
              or checkpointing_reason(layers, path))
    if reason is not None:
        return Unstackable(path, reason)
    kinds = mixed_layer_types(config, len(layers))
    # Layers of several kinds are compared kind by kind when they are stacked;
    # a loop that hands values back runs layer 0 as itself and stacks the rest.
    difference = (None if kinds or loop.hands_back
                  else layers_difference(list(layers), frozenset(per_layer_attributes)))
    if difference is not None:
        error, message = difference
        return Unstackable(path, message, error)
    return LayerList(path, owner, name, layers, config, kinds, loop, output_recorder(model, path))


def _one_class_among(layers: nn.Module, class_names: set) -> bool:
    if isinstance(layers, StackedLayers):
        return type(layers._template).__name__ in class_names
    if isinstance(layers, StackedAfterFirst):
        return type(layers.first).__name__ in class_names
    if isinstance(layers, StackedLayerKinds):
        return type(layers.segments[0]._template.layers[0]).__name__ in class_names
    classes = {type(layer) for layer in layers}
    return len(classes) == 1 and next(iter(classes)).__name__ in class_names


@dataclasses.dataclass(frozen=True)
class LoopShape:
    """How an owner's forward calls its layer list (see `layer_loop`)."""
    # It iterates over the list (`for block in self.h`), rather than slicing it.
    iterated: bool = False
    # Statements of that loop that do more only while a test of the owner's
    # settings holds (`_is_guard`: LayerDrop).
    guards: tuple[LoopGuard, ...] = ()
    # The loop unpacks each layer's tuple and hands its other values back as
    # arguments of the next call (`_hands_back`: T5's position biases).
    hands_back: bool = False


def layer_loop(owner: nn.Module, name: str, path: str) -> tuple[LoopShape, str | None]:
    """How the owner's forward calls the layers, and why a scan cannot stand
    for its loop (None if it can). How: a `LoopShape`, not iterated when it
    takes them as a slice (`for layer in self.layers[: n]`), which yields the
    stack itself; iterated when it iterates over them (`for block in
    self.h`, `enumerate(self.h)`) with a loop body that only calls the layer
    on the hidden state, so that `stack_layers` installs the owner's
    `stacks.ForwardLoop` hooks; with the loop's guards, statements that do
    more only while a test of the owner's settings holds (`_is_guard`:
    LayerDrop); handing back when the call unpacks the layer's tuple
    (`hidden, bias = layer(hidden, mask, position_bias)`) and the body's
    other statements only hand its other values back as arguments of the
    next call (`position_bias = bias`, see `_hands_back`), which
    `stacks.StackedAfterFirst` runs. Why not: no such loop, or the line of a
    loop that does more between the layers."""
    forward = inspect.unwrap(type(owner).forward)
    try:
        lines, first_line = inspect.getsourcelines(forward)
    except (OSError, TypeError):
        lines, first_line = [], 0
    source = textwrap.dedent("".join(lines))
    if re.search(rf"self\.{re.escape(name)}\s*\[", source):
        return LoopShape(), None
    where = type(owner).__qualname__ + ".forward"
    loop = next((node for node in ast.walk(ast.parse(source)) if source and
                 isinstance(node, ast.For) and _iterates_over(node.iter, name)), None)
    if loop is None:
        return LoopShape(), (
            f"{where} neither loops over a slice `self.{name}[...]` nor over "
            f"`self.{name}` itself (or its source is not available), so it would call the "
            f"layers at {path!r} one by one, not as one scan. stack_layers takes over loops of "
            f"the form `for layer in self.{name}[: n]` or `for layer in self.{name}`; for "
            f"other models, call a torch_xla_ext.LayerStack from your own forward")
    layer = loop.target.elts[-1] if isinstance(loop.target, ast.Tuple) else loop.target
    # A statement that only hands values back (under a test of settings, perhaps) is no guard.
    direct_calls = [each for each in loop.body if _only_calls_the_layer(each, layer)]
    guards = [each for each in loop.body if _is_guard(each)
              and not any(_hands_back(each, call) for call in direct_calls)]
    body = [_unless_flag_set(each, loop.body, guards) for each in loop.body if each not in guards]
    calls = [each for each in body if _only_calls_the_layer(each, layer)]
    extra = [each for each in body if len(calls) != 1
             or not (each is calls[0] or _only_looks_up(each, calls[0])
                     or _hands_back(each, calls[0]))]

    def located(statement: ast.stmt) -> tuple[str, str]:
        line = first_line + statement.lineno - 1
        text = source.splitlines()[statement.lineno - 1].strip()
        return f"{forward.__code__.co_filename}:{line}", text

    if extra:
        line, text = located(extra[0])
        return LoopShape(), (
            f"{where} does more between two layers than call the next one on "
            f"the hidden state ({line}: `{text}`); one scan "
            f"runs all the layers at once, so that work would not run between them. Move it "
            f"before or after the loop, or call a torch_xla_ext.LayerStack from your own "
            f"forward")
    guarded = tuple(LoopGuard(where, *located(each), ast.unparse(each.test)) for each in guards)
    return LoopShape(True, guarded, isinstance(calls[0].targets[0], ast.Tuple)), None


def _is_guard(statement: ast.stmt) -> bool:
    """`if <test of the owner's settings>: ...` (BART's LayerDrop: `if
    self.training and self.layerdrop > 0.0:` draws whether to skip the
    layer): while its test is false, it does nothing, whatever its body; while
    it is true, the layers run one by one (`LoopGuard`)."""
    return (isinstance(statement, ast.If) and not statement.orelse
            and _reads_settings_only(statement.test))


def _reads_settings_only(test: ast.expr) -> bool:
    """An expression of `self`'s attributes and constants (no calls), which
    `LoopGuard` evaluates on the owner."""
    allowed = (ast.BoolOp, ast.boolop, ast.Compare, ast.cmpop, ast.UnaryOp, ast.unaryop,
               ast.Attribute, ast.Constant, ast.Load)
    return all(isinstance(node, allowed) or (isinstance(node, ast.Name) and node.id == "self")
               for node in ast.walk(test))


def _unless_flag_set(statement: ast.stmt, body: list, guards: list) -> ast.stmt:
    """The statement under `if not flag:` when the loop sets `flag = False` and
    changes it only under a guard (BART's encoder: `to_drop = False`, then `if
    not to_drop: hidden_states = layer(...)`): while the guards' tests are
    false, it always runs. Else the statement itself."""
    if not (isinstance(statement, ast.If) and not statement.orelse and len(statement.body) == 1
            and isinstance(statement.test, ast.UnaryOp) and isinstance(statement.test.op, ast.Not)
            and isinstance(statement.test.operand, ast.Name)):
        return statement
    flag = statement.test.operand.id
    settings = [each for each in body if each not in guards and any(
        isinstance(node, ast.Name) and node.id == flag and isinstance(node.ctx, ast.Store)
        for node in ast.walk(each))]
    cleared = (len(settings) == 1 and isinstance(settings[0], ast.Assign)
               and isinstance(settings[0].value, ast.Constant) and settings[0].value.value is False)
    return statement.body[0] if cleared else statement


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
    replaced = _names(call.targets[0])
    return (isinstance(statement, ast.Assign)
            and all(isinstance(target, ast.Name) and target.id not in replaced
                    for target in statement.targets)
            and not _calls_anything(statement.value))


def _hands_back(statement: ast.stmt, call: ast.Assign) -> bool:
    """`argument = value`, where `value` is one of the values the layer call
    unpacked after the hidden state and `argument` a name the call passes the
    layer (T5's `position_bias = self_attention_position_bias`), or such
    statements under an `if` without `else` whose test calls nothing: the
    next layer gets what this one returned. The stack checks, as the loop
    runs, that every layer after the first gets the same arguments."""
    if isinstance(statement, ast.If):
        return (not statement.orelse and not _calls_anything(statement.test)
                and all(_hands_back(each, call) for each in statement.body))
    unpacked = call.targets[0]
    returned = _names(unpacked)[1:] if isinstance(unpacked, ast.Tuple) else []
    passed = [each.id for each in (*call.value.args[1:],
                                   *(keyword.value for keyword in call.value.keywords))
              if isinstance(each, ast.Name)]
    return (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name) and statement.targets[0].id in passed
            and isinstance(statement.value, ast.Name) and statement.value.id in returned)


def _only_calls_the_layer(statement: ast.stmt, layer: ast.expr) -> bool:
    """`hidden = layer(hidden, ...)`, or `hidden, other, ... = layer(hidden,
    ...)` of names (a layer that returns a tuple): the layer called on what
    the result (its first value) replaces."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and isinstance(layer, ast.Name)):
        return False
    target, call = statement.targets[0], statement.value
    names = _names(target)
    if not names or (isinstance(target, ast.Tuple) and len(names) != len(target.elts)):
        return False
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            and call.func.id == layer.id and bool(call.args)
            and isinstance(call.args[0], ast.Name) and call.args[0].id == names[0])


def _names(target: ast.expr) -> list[str]:
    """The names a target assigns: `x`, or `x, y, z`."""
    elements = target.elts if isinstance(target, ast.Tuple) else [target]
    return [each.id for each in elements if isinstance(each, ast.Name)]


def _calls_anything(expression: ast.expr) -> bool:
    return any(isinstance(node, ast.Call) for node in ast.walk(expression))


def mixed_layer_types(config, count: int) -> list | None:
    """transformers configs list per-layer kinds (full or sliding attention) in
    `layer_types`, and the forward passes each layer the mask of its kind:
    the kinds when they are not all the same, else None."""
    layer_types = list(getattr(config, "layer_types", None) or ())[:count]
    return layer_types if len(set(layer_types)) > 1 else None


def _kinds_reason(config, count: int) -> str | None:
    kinds = mixed_layer_types(config, count)
    if kinds is not None and len(kinds) < count:
        return (f"config.layer_types lists {len(kinds)} kinds for {count} layers; give every "
                f"layer its kind (or one kind for all)")
    return None


def hooks_reason(layer: nn.Module, path: str) -> str | None:
    for module_path, module in layer.named_modules():
        where = f"{path}.{module_path}" if module_path else path
        for registry in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                         "_backward_hooks"):
            for hook in getattr(module, registry).values():
                if getattr(hook, "__module__", None) == _TRANSFORMERS_CAPTURE_HOOKS:
                    continue
                return (f"{where} has a hook in {registry} "
                        f"({getattr(hook, '__qualname__', hook)!r}); the stacked layers run "
                        f"inside one scan, where hooks of the layers would not run. Remove it "
                        f"first")
    return None


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
