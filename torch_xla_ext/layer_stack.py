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
numbers, strings and the like as they are; tuples, lists, dicts and plain
objects (a transformers config) item by item; functions by their code and
what they close over and default to; partials by their function and
arguments; bound methods by their function and the settings of their `self`;
the layer's own submodules, parameters and buffers by their place in the
layer. What cannot be compared by value (a tensor or module held outside the
layer's registries, an object without attributes) must be the very same
object in every layer. A layer that differs is refused with an error naming it
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
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import math
import operator
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Iterable

import torch
import torch_xla.runtime
from torch import nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from torch_xla_ext.policies import resolve as resolve_policy, save_everything
from torch_xla_ext.scan import Lowered, lower, scan
from torch_xla_ext.scan.mutation import Writes

__all__ = ["LayerStack", "LayerByLayerWarning", "scan_layers"]

# Keys that every nn.Module puts in its __dict__ for its own bookkeeping (hooks,
# registries); `training` is not among them because it changes the computation.
_MODULE_BOOKKEEPING = frozenset(vars(nn.Module())) - {"training"}

# transformers' attention layers keep their index only to pick their key/value cache slot.
_DEFAULT_PER_LAYER_ATTRIBUTES = ("layer_idx",)

# Values that are their own comparable form; they are also the constants a call may pass.
_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, range, enum.Enum,
                torch.dtype, torch.device, torch.layout, torch.memory_format)


# Values compared by identity whose repr names them (`<built-in method tanh ...>`).
_NAMED_BY_REPR = (type, types.ModuleType, types.BuiltinFunctionType, types.MethodDescriptorType,
                  types.WrapperDescriptorType, types.MethodWrapperType)


class LayerByLayerWarning(UserWarning):
    """A LayerStack or scan_layers call ran its layers one by one, as the for loop
    does, instead of as one scan; the message says why."""


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# ---------------------------------------------------------------------------
# Comparable forms of the values layers hold


@dataclasses.dataclass(frozen=True)
class _Composite:
    """The form of a value made of parts: `kind` and every part's form must be
    equal; `parts` pairs a description of each part's place with its form."""
    kind: tuple
    parts: tuple
    shown: str = dataclasses.field(compare=False)


@dataclasses.dataclass(frozen=True)
class _Mark:
    """The form of a value that is not compared as itself (by identity, by its
    place in the layer, ...); `shown` describes it in messages."""
    key: tuple
    shown: str = dataclasses.field(compare=False)


def _describe(form) -> str:
    return form.shown if isinstance(form, (_Composite, _Mark)) else repr(form)


def _by_identity(form) -> bool:
    return isinstance(form, _Mark) and form.key[0] == "identity"


class _LayerReference(Exception):
    """A value that copies of the layer share refers to a module or tensor of the
    layer: `args` are the layer's module or tensor and the sharing holder."""


@functools.cache
def _has_slots(cls: type) -> bool:
    return any(set(vars(base).get("__slots__", ())) - {"__dict__", "__weakref__"}
               for base in cls.__mro__)


class _FormBuilder:
    """Comparable forms of the values one layer holds (the rule is in the module
    docstring). `shared` collects the objects compared by identity, which a copy
    of the layer must share rather than copy."""

    # Deeper than this, objects are compared by identity, which is sound and bounds the work.
    _MAX_DEPTH = 8

    def __init__(self, layer: nn.Module):
        self._places = {id(module): f"module '{path}'"
                        for path, module in layer.named_modules(remove_duplicate=False)}
        for name, tensor in (*layer.named_parameters(remove_duplicate=False),
                             *layer.named_buffers(remove_duplicate=False)):
            self._places[id(tensor)] = f"tensor '{name}'"
        self.shared: list = []
        self._ancestors: list[int] = []
        # (id, by_reference) -> form of an object reached again (a config most
        # submodules hold), unless its form points back at an ancestor.
        self._seen: dict[tuple[int, bool], _Composite] = {}
        self._cycles = 0

    def form(self, value, by_reference: str | None = None):
        """`by_reference`: what `value` is reached through, if a deep copy of the
        layer shares it instead of copying it (a function's closure or defaults,
        a weak reference)."""
        # type() rather than isinstance(): configs make reading __class__ slow.
        kind = type(value)
        if issubclass(kind, float) and math.isnan(value):
            return _Mark(("nan",), "nan")  # which is unequal to itself
        if issubclass(kind, (_VALUE_TYPES, _Mark)):
            return value
        if issubclass(kind, (nn.Module, torch.Tensor)) and id(value) in self._places:
            place = self._places[id(value)]
            if by_reference:
                raise _LayerReference(place, by_reference)
            return _Mark(("in layer", place), f"the layer's {place}")
        if id(value) in self._ancestors:
            self._cycles += 1
            return _Mark(("cycle", self._ancestors.index(id(value))),
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
        return _Mark(("identity", id(value)), shown)

    def _parts(self, labelled, by_reference: str | None) -> tuple:
        return tuple((label, self.form(part, by_reference)) for label, part in labelled)

    def _composite(self, value, kind: type, by_reference: str | None) -> _Composite | None:
        """`value`'s form from its parts, or None if it is compared by identity."""
        if issubclass(kind, (tuple, list)):
            parts = self._parts(((f"item [{i}]", item) for i, item in enumerate(value)),
                                by_reference)
            return _Composite((kind, len(value)), parts, f"a {kind.__name__} of {len(value)}")
        if issubclass(kind, dict):
            keys = tuple(self.form(key, by_reference) for key in value)
            parts = self._parts(((f"key {key!r}", item) for key, item in value.items()),
                                by_reference)
            return _Composite((kind, keys), parts,
                              f"a {kind.__name__} with keys {list(value)!r}")
        if issubclass(kind, (set, frozenset)):
            items = frozenset(self.form(item, by_reference) for item in value)
            return _Composite((kind, items), (), f"the {kind.__name__} {value!r}")
        if issubclass(kind, types.FunctionType):
            return self._function(value)
        if issubclass(kind, functools.partial):
            parts = self._parts(
                (("function of the partial", value.func),
                 *((f"argument [{i}] of the partial", arg) for i, arg in enumerate(value.args)),
                 *((f"keyword {key!r} of the partial", arg)
                   for key, arg in value.keywords.items())), by_reference)
            return _Composite((kind,), parts, f"a partial of {value.func!r}")
        if issubclass(kind, weakref.ref):
            # A copy of the layer shares the weak reference, and so its referent.
            referent = value()
            if referent is None:
                return _Composite((kind, None), (), "a dead weak reference")
            parts = self._parts((("referent of the weak reference", referent),),
                                "a weak reference")
            return _Composite((kind,), parts, "a weak reference")
        if issubclass(kind, types.MethodType):
            parts = self._parts((("function of the method", value.__func__),
                                 ("self of the method", value.__self__)), by_reference)
            return _Composite((kind,), parts, f"method {value.__func__.__qualname__}")
        if (issubclass(kind, (nn.Module, torch.Tensor, type, types.ModuleType))
                or _has_slots(kind)):
            return None
        try:
            attributes = vars(value)
        except TypeError:  # no __dict__
            return None
        parts = self._parts(((f"attribute {name!r}", item) for name, item in attributes.items()),
                            by_reference)
        return _Composite((kind,), parts, f"a {kind.__qualname__}")

    def _function(self, function: types.FunctionType) -> _Composite:
        # A copy of the layer shares its functions, so what they refer to is shared too.
        code = function.__code__
        labelled = []
        for name, cell in zip(code.co_freevars, function.__closure__ or ()):
            try:
                labelled.append((f"closure variable {name!r}", cell.cell_contents))
            except ValueError:  # a cell not yet assigned
                labelled.append((f"closure variable {name!r}", _Mark(("empty cell",), "unset")))
        defaults = function.__defaults__ or ()
        positional = code.co_varnames[:code.co_argcount]
        labelled += [(f"default of {name!r}", default) for name, default in
                     zip(positional[len(positional) - len(defaults):], defaults)]
        labelled += [(f"default of {name!r}", default)
                     for name, default in (function.__kwdefaults__ or {}).items()]
        shown = f"function {function.__qualname__} ({code.co_filename}:{code.co_firstlineno})"
        return _Composite((types.FunctionType, code, id(function.__globals__)),
                          self._parts(labelled, "a function's closure or defaults"), shown)


def _first_difference(reference, other) -> tuple[tuple, Any, Any] | None:
    """(where, reference's form there, other's form there) for the innermost part
    where two forms differ, or None if they are equal."""
    if reference == other:
        return None
    if (isinstance(reference, _Composite) and isinstance(other, _Composite)
            and reference.kind == other.kind
            and [label for label, _ in reference.parts] == [label for label, _ in other.parts]):
        for (label, reference_part), (_, other_part) in zip(reference.parts, other.parts):
            found = _first_difference(reference_part, other_part)
            if found is not None:
                where, reference_form, other_form = found
                return (label, *where), reference_form, other_form
    return (), reference, other


# ---------------------------------------------------------------------------
# Layer layouts and the check that layers are alike


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    is_parameter: bool
    shape: tuple[int, ...]
    dtype: torch.dtype
    # requires_grad for a parameter, persistent (saved in state_dict) for a buffer.
    flag: bool

    def describe(self) -> str:
        flag = ("requires_grad" if self.is_parameter else "persistent") + f"={self.flag}"
        return f"shape {self.shape}, dtype {self.dtype}, {flag}"


@dataclasses.dataclass(frozen=True)
class _LayerLayout:
    """What must agree between the layers of a stack."""
    # Submodule path ('' for the layer itself) -> module type.
    modules: dict[str, type]
    # 'path.attribute' -> comparable form of each submodule's non-tensor attribute.
    settings: dict[str, Any]
    # 'path.attribute' -> the attribute's value.
    values: dict[str, Any]
    # Parameter or buffer name ('self_attn.q_proj.weight') -> spec, in state_dict order.
    tensors: dict[str, _TensorSpec]
    # Objects the settings compare by identity.
    shared: list

    def trace_key(self) -> tuple:
        """The part of the layout that decides what a trace of the layer computes."""
        return tuple(self.modules.items()), tuple(self.settings.items())


def _layout(layer: nn.Module, index: int) -> _LayerLayout:
    """Layer `index`'s layout; raises ValueError if a setting cannot be used."""
    forms = _FormBuilder(layer)
    modules, settings, values, tensors = {}, {}, {}, {}
    for path, module in layer.named_modules():
        modules[path] = type(module)
        for attribute, value in vars(module).items():
            if attribute in _MODULE_BOOKKEEPING:
                continue
            name = _join(path, attribute)
            try:
                settings[name] = forms.form(value)
            except _LayerReference as reference:
                place, holder = reference.args
                raise ValueError(
                    f"Layer {index} setting '{name}' refers to the layer's own {place} through "
                    f"{holder}, which the stack's copy of layer 0 shares rather than copies: "
                    f"every layer would use layer 0's {place}, not its own. Reach it through "
                    f"`self` instead (in a method of the module), or pass it as an argument.") from None
            values[name] = value
        for name, param in module._parameters.items():
            if param is not None:
                tensors[_join(path, name)] = _TensorSpec(True, tuple(param.shape),
                                                         param.dtype, param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                persistent = name not in module._non_persistent_buffers_set
                tensors[_join(path, name)] = _TensorSpec(False, tuple(buffer.shape),
                                                         buffer.dtype, persistent)
    return _LayerLayout(modules, settings, values, tensors, forms.shared)


_SAME_CODE_NOTE = ("the stack runs layer 0's code and settings for every layer, "
                   "so all layers must be built the same way")


def _key_difference(index: int, what: str, reference: dict, other: dict) -> str | None:
    missing = [key for key in reference if key not in other]
    extra = [key for key in other if key not in reference]
    if not missing and not extra:
        return None
    parts = []
    if missing:
        parts.append(f"lacks {what} {missing}")
    if extra:
        parts.append(f"has extra {what} {extra}")
    return (f"Layer {index} differs from layer 0: it {' and '.join(parts)}; "
            f"{_SAME_CODE_NOTE}.")


def _setting_difference(index: int, name: str, where: tuple, reference, other,
                        per_layer_attributes: frozenset[str]) -> str:
    if where:
        message = (f"Layer {index} setting '{name}' differs from layer 0's in its "
                   f"{' → '.join(where)}: {_describe(other)} in layer {index} but "
                   f"{_describe(reference)} in layer 0; {_SAME_CODE_NOTE}.")
    else:
        message = (f"Layer {index} setting '{name}' is {_describe(other)} but layer 0's is "
                   f"{_describe(reference)}; {_SAME_CODE_NOTE}.")
    if _by_identity(reference) or _by_identity(other):
        return message + (
            " What cannot be compared by value (a built-in function, a tensor or module held "
            "outside the layer's parameters, buffers and submodules, an object without "
            "attributes) must be the very same object in every layer; register a per-layer "
            "tensor as a buffer.")
    if where or isinstance(other, _Composite):
        return message + (" Build the layers alike, or hold what differs in a parameter or "
                          "buffer, which the stack keeps per layer.")
    attribute = name.rpartition(".")[2]
    names = (*sorted(per_layer_attributes), attribute)
    return message + (
        f" If '{attribute}' does not change what a layer computes (it only picks a per-layer "
        f"resource, such as a key/value cache slot), pass per_layer_attributes={names!r}: "
        f"each layer then keeps its own value, and calls run as one scan when the layer's "
        f"computation does not read it.")


def _check_same_layout(index: int, reference: _LayerLayout, other: _LayerLayout,
                       per_layer_attributes: frozenset[str]) -> None:
    """Raises TypeError/ValueError naming the first thing layer `index` does differently."""
    message = _key_difference(index, "submodules", reference.modules, other.modules)
    if message:
        raise ValueError(message)
    for path, module_type in reference.modules.items():
        if other.modules[path] is not module_type:
            where = f"submodule '{path}'" if path else "itself"
            raise TypeError(f"Layer {index} {where} is a {other.modules[path].__name__} but "
                            f"layer 0's is a {module_type.__name__}; {_SAME_CODE_NOTE}.")
    message = _key_difference(index, "parameters/buffers", reference.tensors, other.tensors)
    if message:
        raise ValueError(message)
    for name, spec in reference.tensors.items():
        if other.tensors[name] != spec:
            kind = "parameter" if spec.is_parameter else "buffer"
            raise ValueError(
                f"Layer {index} {kind} '{name}' has {other.tensors[name].describe()} but "
                f"layer 0's has {spec.describe()}; the stack keeps one [num_layers, ...] "
                f"tensor per name, so every layer's '{name}' must match layer 0's.")
    message = _key_difference(index, "settings", reference.settings, other.settings)
    if message:
        raise ValueError(message)
    for name, form in reference.settings.items():
        if name.rpartition(".")[2] in per_layer_attributes:
            continue
        difference = _first_difference(form, other.settings[name])
        if difference is not None:
            raise ValueError(_setting_difference(index, name, *difference,
                                                 per_layer_attributes))


def _check_identical_layers(layers: list, per_layer_attributes: frozenset[str]
                            ) -> tuple[_LayerLayout, dict[str, tuple]]:
    """Layer 0's layout, after checking that every layer shares it, and the
    per-layer attributes that differ: 'path.attribute' -> each layer's value."""
    for index, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"Layer {index} is a {type(layer).__name__}, not an nn.Module; "
                            f"pass a list or nn.ModuleList of layers.")
    layouts = [_layout(layer, index) for index, layer in enumerate(layers)]
    reference = layouts[0]
    for index, layout in enumerate(layouts[1:], start=1):
        _check_same_layout(index, reference, layout, per_layer_attributes)
    per_layer_values = {
        name: tuple(layout.values[name] for layout in layouts)
        for name, form in reference.settings.items()
        if name.rpartition(".")[2] in per_layer_attributes
        and any(layout.settings[name] != form for layout in layouts)
    }
    return reference, per_layer_values


def _layer_tensors(layer: nn.Module, names: Iterable[str]) -> dict[str, torch.Tensor]:
    tensors = dict(layer.named_parameters(remove_duplicate=False))
    tensors.update(layer.named_buffers(remove_duplicate=False))
    return {name: tensors[name] for name in names}


# ---------------------------------------------------------------------------
# Watching the template's per-layer attributes while it is traced


class _ReadLog(threading.local):
    # The set that the running step records per-layer attribute reads in, if any.
    reads: set | None = None


_READ_LOG = _ReadLog()


class _PerLayerAttributeRead(BaseException):
    """Abandons a trace that read a per-layer attribute, before the scan runs or
    writes anything; a BaseException, so that no `except Exception` in the
    layer's code can swallow it."""


class _WatchedAttribute:
    """Stands in the class for a per-layer attribute while a call runs: a data
    descriptor, so it sees every attribute read of the instance's own value."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        if _READ_LOG.reads is not None:
            _READ_LOG.reads.add(self.name)
            raise _PerLayerAttributeRead(self.name)
        try:
            return instance.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, instance, value):
        instance.__dict__[self.name] = value

    def __delete__(self, instance):
        del instance.__dict__[self.name]


@functools.cache
def _watching_class(cls: type, names: frozenset[str]) -> type:
    """A subclass of `cls` (same name and module) watching the attributes `names`."""
    watched = {name: _WatchedAttribute(name) for name in names}
    return type(cls.__name__, (cls,),
                {"__module__": cls.__module__, "__qualname__": cls.__qualname__, **watched})


# Serializes the class swaps of templates (a template is swapped by one call at a time).
_WATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def _per_layer_reads_watched(template: nn.Module, per_layer_paths: Iterable[str]):
    """While the block runs, the template's per-layer attributes are watched: a
    step that runs the template records the first it reads and stops there."""
    names_by_owner: dict[str, set[str]] = {}
    for path in per_layer_paths:
        owner_path, _, name = path.rpartition(".")
        names_by_owner.setdefault(owner_path, set()).add(name)
    if not names_by_owner:
        yield
        return
    with _WATCH_LOCK:
        swapped = []
        try:
            for owner_path, names in names_by_owner.items():
                owner = template.get_submodule(owner_path)
                swapped.append((owner, type(owner)))
                owner.__class__ = _watching_class(type(owner), frozenset(names))
            yield
        finally:
            for owner, original in swapped:
                owner.__class__ = original


# ---------------------------------------------------------------------------
# Running the layers


# Per template layer, the scan steps made for it, one per trace key, each with
# the per-layer attributes its traces read. `scan` caches its trace on the
# step's identity, so each combination of layer settings and constant call
# arguments keeps its own step.
_STEPS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()

# Stands in the call key for a tensor argument, which is passed through the carry.
_TENSOR_ARGUMENT = object()


class _NotTraceable(Exception):
    """A call argument that cannot enter a traced loop; the message names it."""


def _argument_path(path) -> str:
    """'args[1]' or "kwargs['mask']" for a leaf path of the pytree `(args, kwargs)`."""
    return ("args" if path[0].idx == 0 else "kwargs") + keystr(path[1:])


def _check_carried(hidden, name: str) -> None:
    """Raises _NotTraceable unless every leaf of `hidden` is a tensor, as a scan carry's."""
    for path, leaf in tree_flatten_with_path(hidden)[0]:
        if not isinstance(leaf, torch.Tensor):
            raise _NotTraceable(f"{name}{keystr(path)} is of type {type(leaf).__name__}, and "
                                f"what goes from layer to layer in a scan must be tensors")


def _split_arguments(args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    """Splits layer call arguments into tensors and a hashable description of the
    rest; raises _NotTraceable for an argument that is neither."""
    leaves, spec = tree_flatten((args, kwargs))
    tensors, constants = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            constants.append(_TENSOR_ARGUMENT)
        elif isinstance(leaf, _VALUE_TYPES):
            # With its type, since True == 1 == 1.0 would otherwise share one trace.
            constants.append((type(leaf), leaf))
        else:
            path = next(path for path, value in tree_flatten_with_path((args, kwargs))[0]
                        if value is leaf)
            raise _NotTraceable(
                f"argument {_argument_path(path)} is of type {type(leaf).__name__}, and only "
                f"tensors and plain constants (None, bool, int, float, str) can enter a "
                f"traced loop")
    return tuple(tensors), (spec, tuple(constants))


def _next_hidden(layer: Callable, hidden, args: tuple, kwargs: dict, drop_in: bool):
    """One iteration of the loop that the layers stand for."""
    if drop_in:
        # As torch_xla's scan_layers: a tuple is the layer's positional arguments,
        # and the layer's whole output is the next layer's input.
        return layer(*hidden) if isinstance(hidden, tuple) else layer(hidden)
    output = layer(hidden, *args, **kwargs)
    # A layer returns the hidden state, or a tuple that starts with it (transformers).
    return output[0] if isinstance(output, tuple) else output


def _make_step(template_ref: weakref.ref, arguments: tuple, drop_in: bool, reads: set):
    spec, constants = arguments

    def run_one_layer(carry, layer_tensors):
        hidden, tensor_arguments = carry
        supplied = iter(tensor_arguments)
        leaves = [next(supplied) if constant is _TENSOR_ARGUMENT else constant[1]
                  for constant in constants]
        args, kwargs = tree_unflatten(leaves, spec)

        def layer(*layer_args, **layer_kwargs):
            return torch.func.functional_call(template_ref(), layer_tensors, layer_args,
                                              layer_kwargs, strict=True)

        outer_reads, _READ_LOG.reads = _READ_LOG.reads, reads
        try:
            hidden = _next_hidden(layer, hidden, args, kwargs, drop_in)
        finally:
            _READ_LOG.reads = outer_reads
        return (hidden, tensor_arguments), None

    return run_one_layer


def _run_layer_by_layer(layer_at: Callable[[int], nn.Module], num_layers: int, hidden,
                        args: tuple, kwargs: dict, drop_in: bool, reason: str,
                        lower_on: str | None = None):
    if lower_on is not None:
        raise ValueError(f"lower: this call would run the {num_layers} layers one by one, not "
                         f"as one scan, so there is no scan to lower: {reason}")
    warnings.warn(f"The {num_layers} layers ran one by one, as the for loop does, instead "
                  f"of as one scan: {reason}.", LayerByLayerWarning, stacklevel=3)
    for index in range(num_layers):
        hidden = _next_hidden(layer_at(index), hidden, args, kwargs, drop_in)
    return hidden


def _run_layers(template: nn.Module, layout: _LayerLayout,
                stacked_tensors: dict[str, torch.Tensor], hidden, args: tuple,
                kwargs: dict, *, per_layer_paths: tuple[str, ...],
                layer_at: Callable[[int], nn.Module], num_layers: int, drop_in: bool,
                partition_fn, is_layer_pure, lower_on: str | None = None) -> Any:
    """Runs `template` once per layer slice of `stacked_tensors`, threading `hidden`.

    `args`/`kwargs` go to every layer; their tensors ride along in the carry
    unchanged, so they reach the layers as loop inputs and gradients flow back to
    them. `layout` is the template's current layout. When the scan cannot stand
    for the loop (see the module docstring), the layers `layer_at(i)` run one by one.
    With `lower_on` (a device kind), nothing runs: the scan is staged and its
    `Lowered` HLO returned.
    """
    try:
        _check_carried(hidden, "input_data" if drop_in else "hidden")
        tensor_arguments, arguments = _split_arguments(args, kwargs)
    except _NotTraceable as reason:
        return _run_layer_by_layer(layer_at, num_layers, hidden, args, kwargs, drop_in,
                                   str(reason), lower_on)
    key = (layout.trace_key(), arguments, drop_in)
    steps = _STEPS.setdefault(template, {})
    if key not in steps:
        reads = set()
        steps[key] = _make_step(weakref.ref(template), arguments, drop_in, reads), reads
    step, reads = steps[key]
    if not reads:
        try:
            with _per_layer_reads_watched(template, per_layer_paths):
                if lower_on is not None:
                    return lower(step, (hidden, tensor_arguments), stacked_tensors,
                                 partition_fn=partition_fn, is_fn_pure=is_layer_pure,
                                 device_kind=lower_on)
                (last_hidden, _), _ = scan(step, (hidden, tensor_arguments), stacked_tensors,
                                           partition_fn=partition_fn, is_fn_pure=is_layer_pure)
            return last_hidden
        except _PerLayerAttributeRead:
            pass  # recorded in `reads`
    read = [path for path in per_layer_paths if path.rpartition(".")[2] in reads]
    return _run_layer_by_layer(
        layer_at, num_layers, hidden, args, kwargs, drop_in,
        f"the layer reads {read}, which differ between layers, so one trace cannot stand for "
        f"all of them (a key/value cache passed to the layers reads its layer index)", lower_on)


def scan_layers(layers: Iterable[nn.Module], input_data, partition_fn=save_everything,
                is_layer_pure=None, *,
                per_layer_attributes: Iterable[str] = _DEFAULT_PER_LAYER_ATTRIBUTES):
    """Runs `layers` in sequence on `input_data` as one scan; returns the last output.

    A drop-in for `torch_xla.experimental.scan_layers.scan_layers`, equivalent to

        for layer in layers:
            input_data = layer(*input_data) if isinstance(input_data, tuple) else layer(input_data)

    a tuple is passed as the layer's positional arguments, and a layer's whole
    output is the next layer's input (so it must have the input's structure,
    shapes and dtypes). The layers must be alike (see the module docstring);
    attributes named in `per_layer_attributes` may differ. `partition_fn` (a
    policy of `torch_xla_ext.policies` or its name, or an AOTAutograd
    partitioner) and `is_layer_pure` go to `scan` as `partition_fn` and
    `is_fn_pure` (None, the
    default, caches the trace as for a pure layer; False traces at every call,
    as torch_xla's default does).

    This stacks the layers' tensors at every call, a copy of all the weights
    that the backward pass flows through too; keep the layers in a `LayerStack`
    to avoid it.
    """
    layers = list(layers)
    if not layers:
        return input_data
    layout, per_layer_values = _check_identical_layers(layers, frozenset(per_layer_attributes))
    per_layer = [_layer_tensors(layer, layout.tensors) for layer in layers]
    stacked = {name: torch.stack([tensors[name] for tensors in per_layer])
               for name in layout.tensors}
    buffers = {name: stacked[name] for name, spec in layout.tensors.items()
               if not spec.is_parameter}
    writes = Writes(buffers.values())
    output = _run_layers(layers[0], layout, stacked, input_data, (), {},
                         per_layer_paths=tuple(per_layer_values), layer_at=layers.__getitem__,
                         num_layers=len(layers), drop_in=True, partition_fn=partition_fn,
                         is_layer_pure=is_layer_pure)
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


class _StackedTensors(nn.Module):
    """Holds the stacked tensors of one submodule path of the layers."""


def _meta_copy(layer: nn.Module, shared: Iterable) -> nn.Module:
    """A deep copy of `layer` whose parameters and buffers are meta tensors (no
    data), sharing the `shared` objects (its settings compared by identity)."""
    memo = {id(value): value for value in shared}
    for param in layer.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"),
                                       requires_grad=param.requires_grad)
    for buffer in layer.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(layer, memo)


def _state_dict_per_layer(stack: "LayerStack", state_dict, prefix: str,
                          local_metadata) -> None:
    """state_dict post-hook: replaces the stacked entries by per-layer ones."""
    storage_prefix = prefix + "stacked."
    stacked = {key[len(storage_prefix):]: state_dict.pop(key)
               for key in list(state_dict) if key.startswith(storage_prefix)}
    for index in range(len(stack)):
        for name, tensor in stacked.items():
            state_dict[f"{prefix}{index}.{name}"] = tensor[index]
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None and stack._template is not None:
        for key in [key for key in metadata
                    if key == storage_prefix[:-1] or key.startswith(storage_prefix)]:
            del metadata[key]
        for index in range(len(stack)):
            for path, module in stack._template.named_modules():
                metadata[_join(f"{prefix}{index}", path)] = {"version": module._version}


class LayerStack(nn.Module):
    """Structurally identical layers, run as one scan with their weights stacked.

    Built from an `nn.ModuleList` (or any iterable) of layers, it copies every
    parameter and buffer into one tensor per name with a leading layer
    dimension, held under `stacked` (`stack.stacked.self_attn.q_proj.weight` is
    `[num_layers, out, in]`); those are its `parameters()`, for optimizers and
    gradient clipping. The original layers are not used afterwards: drop them to
    free their memory.

    `stack(hidden, *args, **kwargs)` runs the layers in order, each called as
    `layer(hidden, *args, **kwargs)` with the same extra arguments (attention
    masks, position ids, rotary embeddings as tensors, or plain constants). When
    a layer returns a tuple its first element is the hidden state for the next
    layer and the rest (attention weights, caches) is discarded: the stack
    returns the last layer's hidden state only. The hidden state must keep its
    shape and dtype from layer to layer. An empty stack returns `hidden`. A
    call that the scan cannot stand for (a key/value cache object among the
    arguments, a layer that reads its `layer_idx`) runs the layers one by one,
    as the loop does (see the module docstring).

    `stack[i]` is layer i as a module of the layers' type whose parameters and
    buffers are views of slice i of the stacked tensors (not Parameters of its
    own) and whose per-layer attributes are layer i's, rebuilt at each access;
    changing its settings does not change the stack. `len(stack)` is the number of layers; iterating yields each layer.

    `state_dict()` and `load_state_dict()` use the per-layer names and tensors an
    `nn.ModuleList` of the same layers would (`3.self_attn.q_proj.weight`), so
    checkpoints move between the two.

    Args:
      layers: the layers, identical in submodule types and names, parameter and
        buffer shapes and dtypes, and settings (dropout `p`, `eps`, `training`,
        activation functions, configs, ...; see the module docstring).
      partition_fn: what the forward loop keeps for the backward loop: a
        policy of `torch_xla_ext.policies` (`save_nothing`, `offload("x")`,
        ...), its name, or an AOTAutograd partitioner; passed to `scan`.
      is_layer_pure: passed to `scan` as `is_fn_pure`.
      per_layer_attributes: names of attributes that may differ between layers,
        each layer keeping its own value; calls whose traced computation reads
        one run layer by layer (see the module docstring).
      ignored_attributes: more names treated as `per_layer_attributes` (its
        former name).
    """

    def __init__(self, layers: Iterable[nn.Module], *, partition_fn=save_everything,
                 is_layer_pure=None,
                 per_layer_attributes: Iterable[str] = _DEFAULT_PER_LAYER_ATTRIBUTES,
                 ignored_attributes: Iterable[str] = ()):
        super().__init__()
        layers = list(layers)
        self.partition_fn = resolve_policy(partition_fn, "LayerStack")
        self.is_layer_pure = is_layer_pure
        self.per_layer_attributes = frozenset(per_layer_attributes) | frozenset(ignored_attributes)
        self.num_layers = len(layers)
        # 'path.attribute' -> each layer's value, for the per-layer attributes that differ.
        self.per_layer_values: dict[str, tuple] = {}
        self.stacked = _StackedTensors()
        # The layer whose code runs each step; kept out of _modules so that it is
        # no part of parameters(), state_dict() or .to().
        self.__dict__["_template"] = None
        self.register_state_dict_post_hook(_state_dict_per_layer)
        if not layers:
            return
        layout, self.per_layer_values = _check_identical_layers(layers,
                                                                 self.per_layer_attributes)
        _check_no_shared_parameters(layers)
        self.__dict__["_template"] = _meta_copy(layers[0], layout.shared)
        self.training = layers[0].training
        with torch.no_grad():
            per_layer = [_layer_tensors(layer, layout.tensors) for layer in layers]
            for name, spec in layout.tensors.items():
                owner_path, _, local_name = name.rpartition(".")
                owner = self._storage(owner_path)
                stacked = torch.stack([tensors[name] for tensors in per_layer])
                if spec.is_parameter:
                    owner.register_parameter(local_name,
                                             nn.Parameter(stacked, requires_grad=spec.flag))
                else:
                    owner.register_buffer(local_name, stacked, persistent=spec.flag)

    def _storage(self, path: str) -> _StackedTensors:
        """The `_StackedTensors` for submodule `path`, created on first use."""
        node = self.stacked
        for part in path.split(".") if path else ():
            if part not in node._modules:
                node.add_module(part, _StackedTensors())
            node = node._modules[part]
        return node

    def _stacked_tensors(self) -> dict[str, torch.Tensor]:
        tensors = dict(self.stacked.named_parameters())
        tensors.update(self.stacked.named_buffers())
        return tensors

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        index = operator.index(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"Layer index {index} is out of range for a LayerStack of "
                             f"{len(self)} layers.")
        layer = copy.deepcopy(self._template)
        for name, tensor in self._stacked_tensors().items():
            owner_path, _, local_name = name.rpartition(".")
            owner = layer.get_submodule(owner_path)
            registry = owner._parameters if local_name in owner._parameters else owner._buffers
            registry[local_name] = tensor[index]
        for path, values in self.per_layer_values.items():
            owner_path, _, name = path.rpartition(".")
            setattr(layer.get_submodule(owner_path), name, values[index])
        return layer

    def __iter__(self):
        return (self[index] for index in range(len(self)))

    def train(self, mode: bool = True) -> "LayerStack":
        super().train(mode)
        if self._template is not None:
            self._template.train(mode)
        return self

    def forward(self, hidden, *args, **kwargs):
        if self._template is None:
            return hidden
        return self._run(hidden, args, kwargs)

    def lower(self, hidden, *args, device_kind: str | None = None, **kwargs) -> Lowered:
        """Stages `self(hidden, *args, **kwargs)` without running it: the HLO of
        its forward and backward loops as they would run on `device_kind`
        (default: the current device's kind), as `torch_xla_ext.lower` gives.
        `hidden` and tensor arguments may be placeholders; nothing is
        transferred or executed."""
        if self._template is None:
            raise ValueError("lower: an empty LayerStack runs no scan")
        if device_kind is None:
            device_kind = torch_xla.runtime.device_type()
        return self._run(hidden, args, kwargs, lower_on=device_kind)

    def _run(self, hidden, args, kwargs, lower_on=None):
        return _run_layers(self._template, _layout(self._template, 0), self._stacked_tensors(),
                           hidden, args, kwargs, per_layer_paths=tuple(self.per_layer_values),
                           layer_at=self.__getitem__, num_layers=len(self), drop_in=False,
                           partition_fn=self.partition_fn, is_layer_pure=self.is_layer_pure,
                           lower_on=lower_on)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        # Gathers the per-layer entries into one stacked entry per tensor, which
        # the `stacked` submodules then load; what is absent or the wrong shape is
        # reported under its per-layer name and keeps the current value.
        # The stacked state_dict lists the persistent tensors only, as checkpoints do.
        for name, current in self.stacked.state_dict(keep_vars=True).items():
            slices = []
            for index in range(len(self)):
                key = f"{prefix}{index}.{name}"
                loaded = state_dict.pop(key, None)
                if loaded is None:
                    if strict:
                        missing_keys.append(key)
                elif loaded.shape != current.shape[1:]:
                    error_msgs.append(
                        f"size mismatch for {key}: copying a param with shape {loaded.shape} from "
                        f"checkpoint, the shape in current model is {current.shape[1:]}.")
                    loaded = None
                slices.append(loaded)
            found = next((loaded for loaded in slices if loaded is not None), None)
            if found is None:
                stacked = current.detach()
            else:
                stacked = torch.stack([
                    current[index].detach().to(found) if loaded is None else loaded
                    for index, loaded in enumerate(slices)
                ])
            state_dict[f"{prefix}stacked.{name}"] = stacked
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        layer_type = type(self._template).__name__ if self._template is not None else "-"
        return f"num_layers={len(self)}, layer={layer_type}"


def _check_no_shared_parameters(layers: list) -> None:
    """LayerStack gives each layer its own slice, which would untie shared parameters."""
    owners = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            first_index, first_name = owners.setdefault(id(param), (index, name))
            if first_index != index:
                raise ValueError(
                    f"Layer {index} parameter '{name}' is the same tensor as layer "
                    f"{first_index}'s '{first_name}'; a LayerStack stores one copy per layer "
                    f"and would untie them. Give each layer its own parameters, or keep "
                    f"the shared one outside the layers.")
