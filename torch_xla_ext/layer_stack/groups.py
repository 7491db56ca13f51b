"""Layers of several kinds (full and sliding-window attention, ...) run as a
few scans, under a loop that calls each layer with its kind's arguments.

The layers' kinds (one hashable per layer) are split into segments of
consecutive layers: a repeating pattern of kinds (period p, as Gemma2's
sliding/full alternation) is one segment whose scan runs a `LayerGroup` of p
consecutive layers per iteration; what follows the last whole period, and
models whose kinds come in blocks (Qwen2's first `max_window_layers`), are
segments of one kind each, scanned one layer per iteration. Each segment is
a `LayerStack`, so group g's position j must be alike to group 0's position
j, while the positions of a group may differ from each other.

`GroupedLayers` holds the segments and looks like the `nn.ModuleList` of the
layers it replaced: `len`, `stack[i]` (layer i, holding views of its slices)
and `state_dict()`/`load_state_dict()` with per-layer names. A loop over all
of it (`for i, layer in enumerate(stack[:n])`) gets one callable per layer,
called in order, each with that layer's kind of arguments: the calls of a
segment's first group record their arguments, the last of them runs the
segment's scan with them, and the later calls hand the hidden state on,
after checking that they pass the very arguments the scan used (a
`kinds.KindCalls` per segment, whose kinds are the positions in a group).
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import re
from typing import Callable, Hashable, Iterable, Sequence

from torch import nn

from torch_xla_ext.layer_stack import optimizer_state, running
from torch_xla_ext.layer_stack.kinds import KindCalls
from torch_xla_ext.layer_stack.stack import LayerStack

__all__ = ["GroupedLayers", "LayerGroup", "Segment", "plan_segments", "unconverted_name"]


class LayerGroup(nn.Module):
    """Consecutive layers run in order, each with its own arguments: the
    "layer" that a segment's scan runs per iteration."""

    def __init__(self, layers: Iterable[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, hidden, calls: Sequence[tuple[tuple, dict]],
                per_position: Sequence[dict] | None = None):
        """`calls[j]` is layer j's (args, kwargs) after the hidden state;
        `per_position[j]`, if given, adds to its kwargs (what a recording
        hands each layer of the group)."""
        for position, (layer, (args, kwargs)) in enumerate(zip(self.layers, calls)):
            if per_position is not None:
                kwargs = {**kwargs, **per_position[position]}
            hidden = running._next_hidden(layer, hidden, args, kwargs, drop_in=False)
        return hidden


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers start, ..., stop - 1, scanned as `groups` groups of `period` layers."""
    start: int
    period: int
    groups: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.groups

    def __str__(self) -> str:
        return (f"layers {self.start}-{self.stop - 1} "
                f"({self.groups} groups of {self.period} layer{'s' * (self.period > 1)})")


def plan_segments(kinds: Sequence[Hashable]) -> list[Segment]:
    """The segments for layers of `kinds`: the whole periods of the smallest
    period that repeats at least twice, if any, then runs of one kind."""
    segments = []
    period = _smallest_period(kinds)
    if period is not None:
        segments.append(Segment(0, period, len(kinds) // period))
    start = segments[0].stop if segments else 0
    while start < len(kinds):
        stop = start + 1
        while stop < len(kinds) and kinds[stop] == kinds[start]:
            stop += 1
        segments.append(Segment(start, 1, stop - start))
        start = stop
    return segments


def _smallest_period(kinds: Sequence[Hashable]) -> int | None:
    for period in range(1, len(kinds) // 2 + 1):
        covered = period * (len(kinds) // period)
        if all(kinds[index] == kinds[index % period] for index in range(covered)):
            return period
    return None


# 'segments.3.5.layers.1.rest': segment 3, group 5, position 1.
_GROUPED_NAME = re.compile(r"segments\.(\d+)\.(\d+)\.layers\.(\d+)(\.|$)")
_LAYER_NAME = re.compile(r"(\d+)(\.|$)")


class GroupedLayers(nn.Module):
    """Layers of several kinds, stacked per segment (see the module docstring).

    Args:
      layers: the layers, in order.
      kinds: each layer's kind; consecutive layers of a segment may differ,
        the layers at the same position of its groups must be alike.
      options: passed to each segment's `LayerStack`.
    """

    def __init__(self, layers: Iterable[nn.Module], kinds: Sequence[Hashable], **options):
        super().__init__()
        layers = list(layers)
        if len(kinds) != len(layers):
            raise ValueError(f"GroupedLayers: {len(kinds)} kinds given for {len(layers)} "
                             f"layers; pass one kind per layer.")
        self.plan = plan_segments(list(kinds))
        self.segments = nn.ModuleList()
        for segment in self.plan:
            groups = [LayerGroup(layers[first:first + segment.period])
                      for first in range(segment.start, segment.stop, segment.period)]
            try:
                self.segments.append(LayerStack(groups, **options))
            except (TypeError, ValueError) as error:
                raise type(error)(
                    f"{segment} run as one scan, so the layers at the same position of each "
                    f"group must be alike (in the message, 'Layer g' is group g and "
                    f"'layers.j' its position j): {error}") from error
        # The model's loop's calls of each segment's layers, by position in a group.
        self._calls = [KindCalls([index % segment.period for index in range(segment.stop
                                                                             - segment.start)],
                                 first=segment.start) for segment in self.plan]
        self.register_state_dict_post_hook(_state_dict_per_layer)
        self.register_load_state_dict_post_hook(_missing_and_unexpected_per_layer)
        optimizer_state.track(self, inner=self.segments)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        optimizer_state.track(self, inner=self.segments)  # a copy, or unpickled

    def layer_parameters(self) -> list[tuple[str, int, str]]:
        """The layers' parameters in the order of the layer list's
        `parameters()`, as `LayerStack.layer_parameters` gives them (a
        segment's groups hold consecutive layers, in order)."""
        return [(f"segments.{number}.{name}", group,
                 unconverted_name(self, f"segments.{number}.{in_group}"))
                for number, stack in enumerate(self.segments)
                for name, group, in_group in stack.layer_parameters()]

    def __len__(self) -> int:
        return self.plan[-1].stop if self.plan else 0

    def _place(self, index: int) -> tuple[int, int, int]:
        """(segment, group, position) of layer `index`."""
        for number, segment in enumerate(self.plan):
            if index < segment.stop:
                group, position = divmod(index - segment.start, segment.period)
                return number, group, position
        raise IndexError(f"Layer index {index} is out of range for {len(self)} layers.")

    def __getitem__(self, index):
        if isinstance(index, slice):
            indices = range(len(self))[index]
            if indices == range(len(self)):
                return [functools.partial(self._called, each) for each in indices]
            return [self[each] for each in indices]
        index = operator.index(index)
        number, group, position = self._place(index + len(self) if index < 0 else index)
        return self.segments[number][group].layers[position]

    def __iter__(self):
        return (self[index] for index in range(len(self)))

    def stack_options(self) -> dict:
        """The options the segments' stacks were made with."""
        return self.segments[0].stack_options()

    def unstacked(self) -> list[nn.Module]:
        """The layers as modules of their own, their tensors copied (LayerStack.unstacked)."""
        return [layer for stack in self.segments for group in stack.unstacked()
                for layer in group.layers]

    def _run_segment(self, segment: Segment, stack: LayerStack, hidden, calls: tuple):
        """Runs a segment's layers on `hidden`, its first group having been
        called with `calls`: one scan (a subclass may run it otherwise, for
        arguments that a scan cannot take as they are)."""
        return stack(hidden, calls=calls)

    def _called(self, index: int, hidden, *args, **kwargs):
        """Layer `index` of the loop over all layers, called in order: the last
        call of a segment's first group runs the segment."""
        number = self._place(index)[0]
        segment, calls = self.plan[number], self._calls[number]
        try:
            if not calls.record(index - segment.start, hidden, args, kwargs):
                return hidden
            return calls.ran(self._run_segment(segment, self.segments[number], hidden,
                                               tuple(calls.calls())))
        finally:
            if index == segment.stop - 1:
                calls.clear()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        # Per-layer keys as the segments' per-group ones, which they then load.
        # Keys of layers beyond len(self) stay, reported as unexpected.
        for key in [key for key in state_dict if key.startswith(prefix)]:
            match = _LAYER_NAME.match(key[len(prefix):])
            if match and int(match.group(1)) < len(self):
                state_dict[prefix + _grouped_name(self, key[len(prefix):])] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)


def _renamed(name: str, pattern: re.Pattern, rename: Callable) -> str:
    match = pattern.match(name)
    return name if match is None else rename(match) + match.group(match.lastindex) + name[match.end():]


def unconverted_name(stack: GroupedLayers, name: str) -> str:
    """'segments.1.2.layers.0.mlp.up_proj.weight' (of a per-group state_dict
    key, relative to the stack) as the layer's own name '4.mlp.up_proj.weight'."""
    def layer_index(match):
        segment = stack.plan[int(match.group(1))]
        return str(segment.start + int(match.group(2)) * segment.period + int(match.group(3)))
    return _renamed(name, _GROUPED_NAME, layer_index)


def _grouped_name(stack: GroupedLayers, name: str) -> str:
    """The inverse of `unconverted_name`."""
    def placed(match):
        number, group, position = stack._place(int(match.group(1)))
        return f"segments.{number}.{group}.layers.{position}"
    return _renamed(name, _LAYER_NAME, placed)


def _state_dict_per_layer(stack: GroupedLayers, state_dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: the segments' per-group keys as per-layer ones."""
    def renamed(key):
        return prefix + unconverted_name(stack, key[len(prefix):])
    for key in [key for key in state_dict if key.startswith(prefix + "segments.")]:
        state_dict[renamed(key)] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [key for key in metadata if key.startswith(prefix + "segments")]:
            entry = metadata.pop(key)
            if _GROUPED_NAME.match(key[len(prefix):]):
                metadata[renamed(key)] = entry


def _missing_and_unexpected_per_layer(stack: GroupedLayers, incompatible_keys) -> None:
    """load_state_dict post-hook: reports keys by their per-layer names."""
    for keys in incompatible_keys:
        keys[:] = [re.sub(r"(^|\.)(segments\.\d+\.\d+\.layers\.\d+(?:\.|$))",
                          lambda match: match.group(1) + unconverted_name(stack, match.group(2)),
                          key) for key in keys]
