"""What makes layers alike: each layer's layout (submodule types, tensor specs,
settings), the check that every layer shares layer 0's, its messages, and
layers' kinds; whether a Parameter is shared between layers (one that every
layer holds stays one: `shared_parameters`). What keeps layers from being
stacked is a value, a `Refusal`, which a constructor raises
(`refusal.exception()`) and `stack_layers` reports."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable

import torch
from torch import nn

from torch_xla_ext.diagnostics import Refusal
from torch_xla_ext.layer_stack.forms import (
    Composite, Constant, FormBuilder, by_identity, describe, differences)

# Keys that every nn.Module puts in its __dict__ for its own bookkeeping (hooks,
# registries); `training` is not among them because it changes the computation.
_MODULE_BOOKKEEPING = frozenset(vars(nn.Module())) - {"training"}

_SAME_CODE_NOTE = ("the stack runs layer 0's code and settings for every layer, "
                   "so all layers must be built the same way")


def join(path: str, name: str) -> str:
    """'path.name', or 'name' at the layer itself."""
    return f"{path}.{name}" if path else name


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    is_parameter: bool
    shape: tuple[int, ...]
    dtype: torch.dtype
    # requires_grad for a parameter, persistent (saved in state_dict) for a buffer.
    flag: bool

    def describe(self) -> str:
        flag = ("requires_grad" if self.is_parameter else "persistent") + f"={self.flag}"
        return f"shape {self.shape}, dtype {self.dtype}, {flag}"


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    """What must agree between the layers of a stack."""
    # Submodule path ('' for the layer itself) -> module type.
    modules: dict[str, type]
    # 'path.attribute' -> comparable form of each submodule's non-tensor attribute.
    settings: dict[str, Any]
    # 'path.attribute' -> the attribute's value.
    values: dict[str, Any]
    # Parameter or buffer name ('self_attn.q_proj.weight') -> spec, in state_dict order.
    tensors: dict[str, TensorSpec]
    # Objects the settings compare by identity.
    shared: list
    # Why no stack can hold the layer, whatever the other layers are: a setting
    # that reaches the layer's own module or tensor through what copies of the
    # layer share; None if none does.
    refusal: Refusal | None

    @functools.cached_property
    def trace_key(self) -> tuple:
        """The part of the layout that decides what a trace of the layer
        computes (made once: a planned call asks it at every scan)."""
        return tuple(self.modules.items()), tuple(self.settings.items())


def layout_of(layer: nn.Module, index: int) -> LayerLayout:
    """Layer `index`'s layout, with its `refusal` if a setting cannot be used."""
    forms = FormBuilder(layer)
    modules, settings, values, tensors = {}, {}, {}, {}
    refusal = None
    for path, module in layer.named_modules():
        modules[path] = type(module)
        for attribute, value in vars(module).items():
            if attribute in _MODULE_BOOKKEEPING:
                continue
            name = join(path, attribute)
            settings[name] = forms.form(value)
            if forms.own_references and refusal is None:  # found in this setting's form
                place, holder = forms.own_references[0]
                refusal = Refusal((
                    f"Layer {index} setting '{name}' refers to the layer's own {place} through "
                    f"{holder}, which the stack's copy of layer 0 shares rather than copies: "
                    f"every layer would use layer 0's {place}, not its own. Reach it through "
                    f"`self` instead (in a method of the module), or pass it as an argument."))
            values[name] = value
        for name, param in module._parameters.items():
            if param is not None:
                tensors[join(path, name)] = TensorSpec(True, tuple(param.shape),
                                                       param.dtype, param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                persistent = name not in module._non_persistent_buffers_set
                tensors[join(path, name)] = TensorSpec(False, tuple(buffer.shape),
                                                       buffer.dtype, persistent)
    return LayerLayout(modules, settings, values, tensors, forms.shared, refusal)


def layouts_of(layers: list) -> list[LayerLayout] | Refusal:
    """Each layer's layout; or why a layer cannot be stacked whatever the others
    are (it is not a module; a setting of it cannot be used), for the first."""
    for index, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            return Refusal(f"Layer {index} is a {type(layer).__name__}, not an nn.Module; "
                           f"pass a list or nn.ModuleList of layers.", TypeError)
    layouts = [layout_of(layer, index) for index, layer in enumerate(layers)]
    return next((layout.refusal for layout in layouts if layout.refusal is not None), layouts)


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
                   f"{' → '.join(where)}: {describe(other)} in layer {index} but "
                   f"{describe(reference)} in layer 0; {_SAME_CODE_NOTE}.")
    else:
        message = (f"Layer {index} setting '{name}' is {describe(other)} but layer 0's is "
                   f"{describe(reference)}; {_SAME_CODE_NOTE}.")
    if by_identity(reference) or by_identity(other):
        return message + (
            " What cannot be compared by value (a built-in function, a tensor or module held "
            "outside the layer's parameters, buffers and submodules, an object without "
            "attributes) must be the very same object in every layer; register a per-layer "
            "tensor as a buffer.")
    if where or isinstance(other, Composite):
        return message + (" Build the layers alike, or hold what differs in a parameter or "
                          "buffer, which the stack keeps per layer.")
    attribute = name.rpartition(".")[2]
    names = (*sorted(per_layer_attributes), attribute)
    return message + (
        f" If '{attribute}' does not change what a layer computes (it only picks a per-layer "
        f"resource, such as a key/value cache slot), pass per_layer_attributes={names!r}: "
        f"each layer then keeps its own value, and calls run as one scan when the layer's "
        f"computation does not read it.")


def names_its_module(index: int, owner_path: str, reference, other,
                     reference_index: int = 0) -> bool:
    """Whether two strings are the dotted names in the model of submodule
    `owner_path` of layer `reference_index` and of layer `index`
    ('model.layers.0.self_attn.q_proj' and 'model.layers.3.self_attn.q_proj':
    peft keeps one in each adapted module), which tell the modules apart
    rather than configure them."""
    if not (isinstance(reference, Constant) and isinstance(other, Constant)
            and reference.kind is other.kind is str):
        return False
    in_reference, in_layer = (f"{layer}.{owner_path}".rstrip(".")
                              for layer in (reference_index, index))
    prefix = reference.value[:-len(in_reference)]
    return reference.value.endswith("." + in_reference) and other.value == prefix + in_layer


def structure_key(layout: LayerLayout) -> tuple:
    """What `structure_difference` compares, as one hashable value: layers
    with equal keys can be stacked together."""
    return (tuple(layout.modules.items()), tuple(layout.tensors.items()),
            tuple(layout.settings))


def structure_difference(index: int, reference: LayerLayout, other: LayerLayout
                         ) -> Refusal | None:
    """How layer `index` is built otherwise than layer 0, beyond the values of
    its settings: other submodules or submodule types, other parameters or
    buffers (names or specs), other setting names. None when it is not; else
    the refusal of layers that must be alike."""
    message = _key_difference(index, "submodules", reference.modules, other.modules)
    if message:
        return Refusal(message)
    for path, module_type in reference.modules.items():
        if other.modules[path] is not module_type:
            where = f"submodule '{path}'" if path else "itself"
            return Refusal((
                f"Layer {index} {where} is a {other.modules[path].__name__} but layer 0's is "
                f"a {module_type.__name__}; {_SAME_CODE_NOTE}."), TypeError)
    message = _key_difference(index, "parameters/buffers", reference.tensors, other.tensors)
    if message:
        return Refusal(message)
    for name, spec in reference.tensors.items():
        if other.tensors[name] != spec:
            kind = "parameter" if spec.is_parameter else "buffer"
            return Refusal((
                f"Layer {index} {kind} '{name}' has {other.tensors[name].describe()} but "
                f"layer 0's has {spec.describe()}; the stack keeps one [num_layers, ...] "
                f"tensor per name, so every layer's '{name}' must match layer 0's."))
    message = _key_difference(index, "settings", reference.settings, other.settings)
    if message:
        return Refusal(message)
    return None


def _setting_difference_of(index: int, reference: LayerLayout, other: LayerLayout,
                           per_layer_attributes: frozenset[str]) -> str | None:
    """The message naming the first setting of layer `index` whose value
    differs from layer 0's (beyond naming its own module), or None."""
    for name, form in reference.settings.items():
        owner_path, _, attribute = name.rpartition(".")
        if attribute in per_layer_attributes:
            continue
        for difference in differences(form, other.settings[name]):
            if not names_its_module(index, owner_path, *difference[1:]):
                return _setting_difference(index, name, *difference, per_layer_attributes)
    return None


def _layout_difference(index: int, reference: LayerLayout, other: LayerLayout,
                       per_layer_attributes: frozenset[str], any_setting: bool
                       ) -> Refusal | None:
    """What layer `index` does otherwise than layer 0, in structure or (unless
    `any_setting`) in a setting's value (see `structure_difference`), or None."""
    structure = structure_difference(index, reference, other)
    if structure is not None or any_setting:
        return structure
    setting = _setting_difference_of(index, reference, other, per_layer_attributes)
    return None if setting is None else Refusal(setting)


def _naming_settings(index: int, reference: LayerLayout, other: LayerLayout,
                     per_layer_attributes: frozenset[str]) -> set[str]:
    """The settings of layer `index` that differ from layer 0's only in naming
    their module (peft's dotted names)."""
    naming = set()
    for name, form in reference.settings.items():
        owner_path, _, attribute = name.rpartition(".")
        found = list(differences(form, other.settings[name]))
        if attribute not in per_layer_attributes and found and all(
                names_its_module(index, owner_path, *difference[1:]) for difference in found):
            naming.add(name)
    return naming


def identical_layers(layers: list, per_layer_attributes: frozenset[str],
                     any_setting: bool = False
                     ) -> tuple[LayerLayout, dict[str, tuple], frozenset[str]] | Refusal:
    """Layer 0's layout, when every layer shares it; the settings kept per
    layer: 'path.attribute' -> each layer's value, for the per-layer
    attributes that differ and for the settings that differ only in naming
    their module; and which of those are watched (all of them: a trace that
    reads one runs layer by layer). With `any_setting`, the layers need only
    share layer 0's structure: every setting that differs is kept per layer,
    the others unwatched (layers' kinds: `layer_kinds`). Else the refusal of
    the first layer that does not share it (or that no stack can hold)."""
    layouts = layouts_of(layers)
    if isinstance(layouts, Refusal):
        return layouts
    reference = layouts[0]
    difference = next(filter(None, (
        _layout_difference(index, reference, other, per_layer_attributes, any_setting)
        for index, other in enumerate(layouts[1:], start=1))), None)
    if difference is not None:
        return difference
    naming = set().union(*(_naming_settings(index, reference, other, per_layer_attributes)
                           for index, other in enumerate(layouts[1:], start=1)))
    differing = {name for name, form in reference.settings.items()
                 if any(each.settings[name] != form for each in layouts)}
    watched = frozenset(name for name in differing
                        if name in naming or name.rpartition(".")[2] in per_layer_attributes)
    per_layer_values = {name: tuple(each.values[name] for each in layouts)
                        for name in reference.settings
                        if name in watched or (any_setting and name in differing)}
    return reference, per_layer_values, watched


def layer_kinds(layouts: list[LayerLayout], per_layer_attributes: frozenset[str]
                ) -> tuple[int, ...]:
    """Each layer's kind: layers whose settings are equal, but for the
    per-layer attributes and strings naming their own module, are of one kind
    (numbered in order of their first layer)."""
    kinds, firsts = [], []
    for index, layout in enumerate(layouts):
        kind = next((number for number, first in enumerate(firsts)
                     if _same_settings(layouts[first], first, layout, index,
                                       per_layer_attributes)), None)
        if kind is None:
            kind = len(firsts)
            firsts.append(index)
        kinds.append(kind)
    return tuple(kinds)


def _same_settings(reference: LayerLayout, reference_index: int, layout: LayerLayout,
                   index: int, per_layer_attributes: frozenset[str]) -> bool:
    if structure_key(reference) != structure_key(layout):
        return False
    for name, form in reference.settings.items():
        owner_path, _, attribute = name.rpartition(".")
        if attribute in per_layer_attributes:
            continue
        if any(not names_its_module(index, owner_path, *difference[1:], reference_index)
               for difference in differences(form, layout.settings[name])):
            return False
    return True


def layer_tensors(layer: nn.Module, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Layer's parameters and buffers named `names`, by name."""
    tensors = dict(layer.named_parameters(remove_duplicate=False))
    tensors.update(layer.named_buffers(remove_duplicate=False))
    return {name: tensors[name] for name in names}


def stackable_layers(layers: list, per_layer_attributes: frozenset[str], any_setting: bool,
                     first: int = 0, period: int = 1, shared: frozenset[str] = frozenset()
                     ) -> tuple[LayerLayout, dict[str, tuple], frozenset[str]] | Refusal:
    """What a `LayerStack` checks of its (non-empty) layers: what
    `alike.identical_layers` gives, or why the stack cannot hold them (layers
    not alike, a parameter shared between two, unless every layer holds it
    under a name in `shared`). `layers` are layers `first`, ... of a list, or
    its groups of `period` layers from there (the refusal names the list's
    layers)."""
    alike = identical_layers(layers, per_layer_attributes, any_setting)
    if isinstance(alike, Refusal):
        return alike
    return _shared_parameter(layers, first, period, shared) or alike


def shared_parameters(layers: list) -> frozenset[str]:
    """The names under which every one of several layers holds the same
    Parameter (a block they share)."""
    if len(layers) < 2:
        return frozenset()
    first, *others = (dict(layer.named_parameters()) for layer in layers)
    return frozenset(name for name, param in first.items()
                     if all(other.get(name) is param for other in others))


def _shared_parameter(layers: list, first: int, period: int, shared: frozenset[str]
                      ) -> Refusal | None:
    """LayerStack gives each layer its own slice, which would untie shared parameters."""
    owners = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            if name in shared:
                continue
            if period > 1:  # a group's "layers.<position>.<name>"
                _, position, name = name.split(".", 2)
                place = (first + index * period + int(position), name)
            else:
                place = (first + index, name)
            first_index, first_place = owners.setdefault(id(param), (index, place))
            if first_index != index:  # within a group, shared as the group's own
                return Refusal((
                    f"Layer {place[0]} parameter '{place[1]}' is the same tensor as layer "
                    f"{first_place[0]}'s '{first_place[1]}'; a LayerStack stores one copy per "
                    f"layer and would untie them (a tensor every layer of the segment holds "
                    f"stays one, but not one some of them share). Give each layer its own "
                    f"parameters, or keep the shared one outside the layers."))
    return None
