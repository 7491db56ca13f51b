"""Comparable forms of the values a layer holds, and where two forms differ.

The rule (the package docstring says it for users): numbers, strings and the
like compare as themselves, type included; tuples, lists, dicts, sets and
plain objects (a transformers config) part by part; functions by their code and what they
close over and default to; partials and bound methods by their parts; the
layer's own submodules, parameters and buffers by their place in the layer;
anything else (a tensor or module held outside the layer's registries, an
object without attributes) by identity. The parts come from the one object
walk, `torch_xla_ext.object_graph.children`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types
import weakref
from typing import Any

import torch
from torch import nn

from torch_xla_ext.object_graph import EMPTY_CELL, VALUE_TYPES, children, label

# Values compared by identity whose repr names them (`<built-in method tanh ...>`).
_NAMED_BY_REPR = (type, types.ModuleType, types.BuiltinFunctionType, types.MethodDescriptorType,
                  types.WrapperDescriptorType, types.MethodWrapperType)


@dataclasses.dataclass(frozen=True)
class Constant:
    """The form of a plain value: equal only to an equal value of the same type,
    since True, 1 and 1.0 compute differently (as scan's cache key has it)."""
    kind: type
    value: Any

    def __repr__(self):
        return repr(self.value)


@dataclasses.dataclass(frozen=True)
class Composite:
    """The form of a value made of parts: `kind` and every part's form must be
    equal; `parts` pairs a description of each part's place with its form."""
    kind: tuple
    parts: tuple
    shown: str = dataclasses.field(compare=False)


@dataclasses.dataclass(frozen=True)
class Mark:
    """The form of a value that is not compared as itself (by identity, by its
    place in the layer, ...); `shown` describes it in messages."""
    key: tuple
    shown: str = dataclasses.field(compare=False)


def describe(form) -> str:
    return form.shown if isinstance(form, (Composite, Mark)) else repr(form)


def by_identity(form) -> bool:
    return isinstance(form, Mark) and form.key[0] == "identity"


@functools.cache
def _has_slots(cls: type) -> bool:
    return any(set(vars(base).get("__slots__", ())) - {"__dict__", "__weakref__"}
               for base in cls.__mro__)


class FormBuilder:
    """Comparable forms of the values one layer holds. `shared` collects the
    objects compared by identity, which a copy of the layer must share rather
    than copy."""

    # Deeper than this, objects are compared by identity, which is sound and bounds the work.
    _MAX_DEPTH = 8

    def __init__(self, layer: nn.Module):
        self._places = {id(module): f"module '{path}'"
                        for path, module in layer.named_modules(remove_duplicate=False)}
        for name, tensor in (*layer.named_parameters(remove_duplicate=False),
                             *layer.named_buffers(remove_duplicate=False)):
            self._places[id(tensor)] = f"tensor '{name}'"
        self.shared: list = []
        # (place, holder) of each of the layer's own modules or tensors reached
        # through what copies of the layer share (`by_reference`), in the order
        # found: a copy of layer 0 would use layer 0's, not its own.
        self.own_references: list[tuple[str, str]] = []
        self._ancestors: list[int] = []
        # (id, by_reference) -> form of an object reached again (a config most
        # submodules hold), unless its form points back at an ancestor.
        self._seen: dict[tuple[int, str | None], Composite] = {}
        self._cycles = 0

    def form(self, value, by_reference: str | None = None):
        """`by_reference`: what `value` is reached through, if a deep copy of the
        layer shares it instead of copying it (a function's closure or defaults,
        a weak reference)."""
        # type() rather than isinstance(): configs make reading __class__ slow.
        kind = type(value)
        if issubclass(kind, float) and math.isnan(value):
            return Mark(("nan",), "nan")  # which is unequal to itself
        if issubclass(kind, VALUE_TYPES):
            return Constant(kind, value)
        if value is EMPTY_CELL:
            return Mark(("empty cell",), "unset")
        if issubclass(kind, (nn.Module, torch.Tensor)) and id(value) in self._places:
            place = self._places[id(value)]
            if by_reference:
                self.own_references.append((place, by_reference))
            return Mark(("in layer", place), f"the layer's {place}")
        if id(value) in self._ancestors:
            self._cycles += 1
            return Mark(("cycle", self._ancestors.index(id(value))),
                        "a reference back to a value that contains it")
        seen_key = (id(value), by_reference)
        if seen_key in self._seen:
            return self._seen[seen_key]
        composite = None
        if len(self._ancestors) < self._MAX_DEPTH:
            cycles = self._cycles
            self._ancestors.append(id(value))
            try:
                composite = self._composite(value, kind, by_reference)
            finally:
                self._ancestors.pop()
            if composite is not None and self._cycles == cycles:
                self._seen[seen_key] = composite
        if composite is not None:
            return composite
        self.shared.append(value)
        if issubclass(kind, _NAMED_BY_REPR):
            shown = repr(value)
        else:
            shown = f"the {type(value).__qualname__} object at {id(value):#x}"
        return Mark(("identity", id(value)), shown)

    def _composite(self, value, kind: type, by_reference: str | None) -> Composite | None:
        """`value`'s form from its parts, or None if it is compared by identity."""
        if (issubclass(kind, (nn.Module, torch.Tensor, type, types.ModuleType))
                or _has_slots(kind)):
            return None
        if issubclass(kind, (set, frozenset)):
            members = frozenset(self.form(member, by_reference) for _, member in children(value))
            return Composite((kind, members), (), f"the {kind.__name__} {value!r}")
        if issubclass(kind, types.FunctionType):
            # A copy of the layer shares its functions, so what they refer to is shared too.
            by_reference = "a function's closure or defaults"
            code = value.__code__
            key = (types.FunctionType, code, id(value.__globals__))
            shown = f"function {value.__qualname__} ({code.co_filename}:{code.co_firstlineno})"
        elif issubclass(kind, weakref.ref):
            if value() is None:
                return Composite((kind, None), (), "a dead weak reference")
            # A copy of the layer shares the weak reference, and so its referent.
            by_reference = "a weak reference"
            key, shown = (kind,), "a weak reference"
        elif issubclass(kind, functools.partial):
            key, shown = (kind,), f"a partial of {value.func!r}"
        elif issubclass(kind, types.MethodType):
            key, shown = (kind,), f"method {value.__func__.__qualname__}"
        elif issubclass(kind, (tuple, list)):
            key, shown = (kind, len(value)), f"a {kind.__name__} of {len(value)}"
        elif issubclass(kind, dict):
            key = (kind, tuple(self.form(item_key, by_reference) for item_key in value))
            shown = f"a {kind.__name__} with keys {list(value)!r}"
        elif hasattr(value, "__dict__") or issubclass(kind, slice):
            key, shown = (kind,), f"a {kind.__qualname__}"
        else:
            return None
        parts = tuple((label(value, step), self.form(child, by_reference))
                      for step, child in children(value))
        return Composite(key, parts, shown)


def differences(reference, other):
    """(where, reference's form there, other's form there) for each innermost part
    where two forms differ, in order; nothing if they are equal."""
    if reference == other:
        return
    if (isinstance(reference, Composite) and isinstance(other, Composite)
            and reference.kind == other.kind
            and [label for label, _ in reference.parts] == [label for label, _ in other.parts]):
        for (part_label, reference_part), (_, other_part) in zip(reference.parts, other.parts):
            for where, reference_form, other_form in differences(reference_part, other_part):
                yield (part_label, *where), reference_form, other_form
        return
    yield (), reference, other
