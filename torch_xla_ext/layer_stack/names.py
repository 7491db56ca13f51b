"""The one map between a stack's stored tensors and the layers' own names.

A stack keeps its layers' tensors in parts: a segment's tensors stacked
along its groups (`segments.1.stacked.mlp.up_proj.weight`, `[groups, ...]`;
a group of several layers names its positions `layers.j.`), or a layer held
as itself (`segments.0.mlp.up_proj.weight`). The `nn.ModuleList` it replaced
names them per layer (`4.mlp.up_proj.weight`). `NameMap` maps one onto the
other, and everything that shows the unconverted layout derives from it:
`state_dict()` (`save_per_layer`, `per_layer_metadata`), `load_state_dict()`
and the keys it reports missing (`load_per_layer`), and the layers'
parameters in the unconverted order (`NameMap.parameters`, which optimizer
state dicts use: `optimizer_state`).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import nn

from torch_xla_ext.layer_stack.segments import Segment

__all__ = ["NameMap", "Part", "StoredTensor", "load_per_layer", "part_of", "per_layer_metadata",
           "save_per_layer"]


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """A tensor of one layer (or of one group of `period` layers, named
    `layers.j.<name>` for position j), as a part stores it."""
    name: str  # relative to the layer or group
    is_parameter: bool
    persistent: bool  # saved in state_dict (parameters always)


@dataclasses.dataclass(frozen=True)
class Part:
    """Where the tensors of one segment's layers are: under `prefix`,
    stacked along the groups (`stacked`) or as the layer's own."""
    prefix: str  # relative to the stack: 'segments.1.stacked.', or '' for a LayerStack's own
    segment: Segment
    tensors: tuple[StoredTensor, ...]  # in the order of the layer's (group's) state_dict
    stacked: bool
    # Per position in a group: each submodule path of its layer and its module's
    # version (state_dict metadata).
    versions: tuple[tuple[tuple[str, int], ...], ...] = ()

    def position_of(self, name: str) -> tuple[int, str]:
        """(position in the group, the name in that layer) of a stored tensor name."""
        if self.segment.period == 1:
            return 0, name
        _, position, rest = name.split(".", 2)  # 'layers.j.<rest>'
        return int(position), rest


def part_of(prefix: str, segment: Segment, layer: nn.Module, stacked: bool) -> Part:
    """The part of the layers of `segment` kept under `prefix`, stacked along
    the groups or as the layer itself; `layer` is the layer (stacked: one
    layer, or a group whose `layers.j` is position j) that names the tensors
    and modules. Its tensors are read for their specs only (meta tensors do)."""
    tensors = []
    for path, module in layer.named_modules(remove_duplicate=False):
        tensors += [StoredTensor(f"{path}.{name}".lstrip("."), True, True)
                    for name, param in module._parameters.items() if param is not None]
        tensors += [StoredTensor(f"{path}.{name}".lstrip("."), False,
                                 name not in module._non_persistent_buffers_set)
                    for name, buffer in module._buffers.items() if buffer is not None]
    positions = ([layer] if segment.period == 1
                 else [layer.get_submodule(f"layers.{position}")
                       for position in range(segment.period)])
    versions = tuple(tuple((path, module._version) for path, module in each.named_modules())
                     for each in positions)
    return Part(prefix, segment, tuple(tensors), stacked, versions)


@dataclasses.dataclass(frozen=True)
class _Entry:
    stored: str  # relative to the stack
    slice: int | None  # the group, when stacked
    per_layer: str  # '4.mlp.up_proj.weight'
    tensor: StoredTensor


class NameMap:
    """Stored names <-> per-layer names of the parts of one stack."""

    def __init__(self, parts: Iterable[Part]):
        self.parts = tuple(parts)
        entries = []
        for part in self.parts:
            segment = part.segment
            for group in range(segment.groups):
                for tensor in part.tensors:
                    position, name = part.position_of(tensor.name)
                    layer = segment.start + group * segment.period + position
                    entries.append((layer, _Entry(part.prefix + tensor.name,
                                                  group if part.stacked else None,
                                                  f"{layer}.{name}", tensor)))
        # The unconverted order: layer by layer, each layer's tensors in its own order.
        entries.sort(key=lambda each: each[0])
        self.entries = tuple(entry for _, entry in entries)
        self._by_per_layer = {entry.per_layer: entry for entry in self.entries}
        self._by_stored: dict[str, list[_Entry]] = {}
        for entry in self.entries:
            self._by_stored.setdefault(entry.stored, []).append(entry)

    def parameters(self) -> list[tuple[str, int | None, str]]:
        """The layers' parameters in the order of the unconverted list's
        `parameters()`, each as (its stored name, its slice of it or None,
        its per-layer name)."""
        return [(entry.stored, entry.slice, entry.per_layer) for entry in self.entries
                if entry.tensor.is_parameter]

    def per_layer_name(self, stored: str) -> str:
        """The per-layer name of a stored name that is no stacked tensor (a
        layer held as itself), or of a key that names no tensor, as it is."""
        entries = self._by_stored.get(stored, ())
        return entries[0].per_layer if len(entries) == 1 else stored

    def stored(self, per_layer: str) -> tuple[str, int | None] | None:
        """(stored name, slice or None) of a per-layer name, or None."""
        entry = self._by_per_layer.get(per_layer)
        return None if entry is None else (entry.stored, entry.slice)

    def module_versions(self) -> dict[str, int]:
        """Each per-layer module path ('4.mlp', '4' for the layer) -> its version."""
        versions = {}
        for part in self.parts:
            segment = part.segment
            for group in range(segment.groups):
                for position, modules in enumerate(part.versions):
                    layer = segment.start + group * segment.period + position
                    for path, version in modules:
                        versions[f"{layer}.{path}".rstrip(".")] = version
        return versions


def save_per_layer(names: NameMap, state_dict: dict, prefix: str) -> None:
    """A stack's state_dict post-hook: its stored entries as per-layer ones,
    in the unconverted order (each stacked tensor's slices are views)."""
    stored = {key[len(prefix):]: state_dict.pop(key) for key in list(state_dict)
              if key.startswith(prefix) and key[len(prefix):] in names._by_stored}
    for entry in names.entries:
        if entry.stored in stored:
            tensor = stored[entry.stored]
            state_dict[prefix + entry.per_layer] = (tensor if entry.slice is None
                                                    else tensor[entry.slice])


def load_per_layer(names: NameMap, current: dict[str, torch.Tensor], state_dict: dict,
                   prefix: str, strict: bool, missing_keys: list, error_msgs: list) -> None:
    """A stack's load_state_dict pre-hook: the per-layer entries of
    `state_dict` as the stored ones (`current`: the stored persistent
    tensors, by stored name), which the stack's modules then load. A tensor
    or slice absent or of the wrong shape is reported under its per-layer
    name and keeps its current value; keys of layers the stack does not have
    stay, reported as unexpected."""
    for stored, entries in names._by_stored.items():
        if stored not in current:
            continue  # not persistent
        tensor = current[stored]
        if entries[0].slice is None:
            key = prefix + entries[0].per_layer
            if key in state_dict:
                state_dict[prefix + stored] = state_dict.pop(key)
            else:
                if strict:
                    missing_keys.append(key)
                state_dict[prefix + stored] = tensor.detach()
            continue
        slices = []
        for entry in entries:
            key = prefix + entry.per_layer
            loaded = state_dict.pop(key, None)
            if loaded is None:
                if strict:
                    missing_keys.append(key)
            elif loaded.shape != tensor.shape[1:]:
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {loaded.shape} from "
                    f"checkpoint, the shape in current model is {tensor.shape[1:]}.")
                loaded = None
            slices.append(loaded)
        found = next((each for each in slices if each is not None), None)
        state_dict[prefix + stored] = tensor.detach() if found is None else torch.stack(
            [tensor[index].detach().to(found) if each is None else each
             for index, each in enumerate(slices)])


def per_layer_metadata(names: NameMap, state_dict: dict, prefix: str) -> None:
    """The state_dict's module versions under the per-layer module paths,
    in place of the stored modules'."""
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is None:
        return
    for key in [key for key in metadata if key.startswith(prefix) and key != prefix[:-1]]:
        del metadata[key]
    for path, version in names.module_versions().items():
        metadata[prefix + path] = {"version": version}
