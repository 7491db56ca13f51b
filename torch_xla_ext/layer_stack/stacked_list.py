"""`StackedList`: a list of layers of any structure, stacked in segments.

The layers are split by their structure (submodules, tensors, setting
names) into the segments of `segments.plan_segments`: each run of layers
alike, and each pattern that repeats, is a `LayerStack` over its groups
(`segments.s.stacked...`, `[groups, ...]`); a layer alike to none of its
neighbours is held as itself (`segments.s...`). Settings may differ between
the layers of a segment (each layer keeps its own); which layers one trace
can run is decided per call (`planner`).

It is the `nn.ModuleList` it replaced, as code that walks the model sees
it: the layers themselves are its children "0", "1", ..., the same objects
with the same Parameters (leaf tensors, under their unconverted names), so
`modules()`, `parameters()`, `state_dict()`, optimizers and per-layer
param groups see the unconverted model. Each segment stores its layers'
tensors once, stacked (`storage.LayerStorage`), the layers' tensors views
of their slices; the segments' stacks are not children (no module or
tensor is counted twice). `unstacked()` gives the layers back, each with
tensors of its own.
Why a list cannot be stacked is known before anything is built, as a value:
`stacking_refusal`, from the checks the constructors raise from.
"""
from __future__ import annotations

import copy
import dataclasses
import operator
import weakref
from typing import Iterable, Sequence

from torch import nn

from torch_xla_ext.layer_stack import scan_runner, sharding, stacked_steps
from torch_xla_ext.layer_stack.execution import scan_result
from torch_xla_ext.layer_stack.executors import executor_of_call
from torch_xla_ext.layer_stack.addressed import (
    HookWatch, RefusedEdits, SettingsSnapshot, layouts_again, strip_hooks)
from torch_xla_ext.layer_stack.alike import (
    LayerLayout, Refusal, layer_kinds, layouts_of, shared_parameters, stackable_layers,
    structure_difference, structure_key)
from torch_xla_ext.layer_stack.kinds import hidden_of
from torch_xla_ext.layer_stack.owner_loops import (
    TracedLayerCall, active_driver, at_graph_break, iterated, loop_item, traced_driver)
from torch_xla_ext.layer_stack.per_layer import DEFAULT_PER_LAYER_ATTRIBUTES
from torch_xla_ext.layer_stack.segments import Segment, plan_segments
from torch_xla_ext.layer_stack.stack import LayerStack, checked_stack_options
from torch_xla_ext.policies import save_everything

__all__ = ["LayerGroup", "SegmentStack", "StackedList", "stacking_refusal"]

# Settings compared by value for `differing_settings` (others by identity).
_PLAIN = (type(None), bool, int, float, str)

# Per segment template, its copies with the settings of other kinds of layers.
_KIND_TEMPLATES: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


class LayerGroup(nn.Module):
    """Consecutive layers run in order, each with its own arguments: the
    "layer" that a segment of a repeating pattern scans per step."""

    def __init__(self, layers: Iterable[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, hidden, calls: Sequence[tuple[tuple, dict]],
                per_position: Sequence[dict] | None = None):
        """`calls[j]` is layer j's (args, kwargs) after the hidden state;
        `per_position[j]`, if given, adds to its kwargs (what a recording hands
        each layer of the group). Each layer's output (its first value, for a
        tuple) is the next one's input."""
        for position, (layer, (args, kwargs)) in enumerate(zip(self.layers, calls)):
            extra = per_position[position] if per_position is not None else {}
            hidden = hidden_of(layer(hidden, *args, **{**kwargs, **extra}))
        return hidden


class SegmentStack(LayerStack):
    """The stack of one segment of a `StackedList`, which names its tensors;
    its layers need only be alike in structure."""
    owns_names = False
    keeps_differing_settings = True
    stores_in_layers = True

    def layer(self, index: int, copied: bool = False) -> nn.Module:
        """Member `index` itself (a layer, or a group of a repeating pattern)."""
        return self.members[index]


class StackedList(RefusedEdits, nn.Module):
    """Layers of any structure, stacked per segment (see the module docstring).

    Layers it cannot stack raise the TypeError or ValueError of
    `stacking_refusal`, which says why as a value.

    Args:
      layers: the layers, in order.
      options: passed to each segment's `LayerStack` (`partition_fn`,
        `is_layer_pure`, `unroll`, `per_layer_attributes`).
    """

    def __init__(self, layers: Iterable[nn.Module], **options):
        super().__init__()
        layers = list(layers)
        split = _split(layers,
                       checked_stack_options("StackedList", **options)["per_layer_attributes"])
        if isinstance(split, Refusal):
            raise split.exception()
        self.options = options
        layouts, self.plan = split.layouts, split.plan
        # (segment number, group, position) of each layer, asked at its calls.
        self._places = tuple((number, *segment.place(index))
                             for number, segment in enumerate(self.plan)
                             for index in range(segment.start, segment.stop))
        # Where no two neighbouring layers are built alike, how layer 1 differs
        # from layer 0: no run makes a scan, and each layer runs as itself.
        self.unlike_neighbours = (
            structure_difference(1, layouts[0], layouts[1]).reason.split(";")[0]
            if len(self.plan) > 1 and all(segment.single for segment in self.plan) else None)
        # Not children: what they hold is the layers' (see the module docstring).
        self.__dict__["segments"] = [
            members[0] if segment.single else SegmentStack(members, **options)
            for segment, members in zip(self.plan, split.members)]
        for stack in self.stacks():
            strip_hooks(stack.template, self.replays_hook)
        self._hooks = HookWatch()
        for index, layer in enumerate(layers):  # the layers themselves, as unconverted
            self.add_module(str(index), layer)
        per_layer = frozenset(options.get("per_layer_attributes", DEFAULT_PER_LAYER_ATTRIBUTES))
        self.kinds = layer_kinds(layouts, per_layer)
        self._settings_read, self._settings_key = SettingsSnapshot(layers), ()
        sharding.keep_whole(StackedList)
        stacked_steps.step_stacked()

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._settings_read = SettingsSnapshot(list(self._modules.values()))  # a copy, or unpickled
        self._hooks.forget()
        sharding.keep_whole(StackedList)
        stacked_steps.step_stacked()

    def settings_key(self) -> tuple:
        """The layers' settings, as part of the kind of a call: read again
        when one of them changed since the last read (`addressed`)."""
        if self._settings_read.changed():
            self._read_settings()
        return self._settings_key, self.hooked_layers()

    def hooked_layers(self) -> tuple[int, ...]:
        """The layers with module hooks of their own: they run as themselves."""
        return self._hooks.hooked(list(self._modules.values()), self.replays_hook)

    @staticmethod
    def replays_hook(hook) -> bool:
        """Whether the stacks' templates keep a layer's `hook`, replayed after
        a scan on each layer's values (`hooks`), not running the layer as itself."""
        return False

    def settings_read(self) -> None:
        """Called once the stacks read the layers' settings again: what a
        subclass takes from them itself (none here)."""

    def _read_settings(self) -> None:
        layers = [self._modules[str(index)] for index in range(len(self))]
        layouts = layouts_again(layers, self.plan)
        for stack in self.stacks():
            stack.read_settings()
        self.settings_read()
        self.kinds = layer_kinds(layouts, frozenset(self.options.get(
            "per_layer_attributes", DEFAULT_PER_LAYER_ATTRIBUTES)))
        self._settings_key = tuple(layout.trace_key for layout in layouts)
        self._settings_read = SettingsSnapshot(layers)
        self._hooks.forget()  # a hook dict may be another

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for stack in self.stacks():  # the layers' tensors moved or cast: stacked again
            stack.storage.restacked()
            stack.tie_shared()
        return self

    def train(self, mode: bool = True) -> "StackedList":
        super().train(mode)
        for stack in self.stacks():
            stack.train(mode)
        return self

    def stacks(self) -> list[LayerStack]:
        """The segments' stacks (not the layers held as themselves)."""
        return [each for each in self.segments if isinstance(each, SegmentStack)]

    def stack_options(self) -> dict:
        """The options the segments' stacks were made with (resolved: a
        policy's name as the policy), to make another alike."""
        stacks = self.stacks()
        return stacks[0].stack_options() if stacks else dict(self.options)

    partition_fn = property(lambda self: self.stack_options().get("partition_fn",
                                                                  save_everything))
    unroll = property(lambda self: self.stack_options().get("unroll", 1))

    def __len__(self) -> int:
        return len(self._places)

    def place(self, index: int) -> tuple[int, int, int]:
        """(segment number, group, position) of layer `index`."""
        if not 0 <= index < len(self._places):
            raise IndexError(f"Layer index {index} is out of range for {len(self)} layers.")
        return self._places[index]

    def call_kind(self, index: int) -> tuple[int, int, int]:
        """What layer `index`'s calls compute, as far as the stack knows: its
        (segment number, position in a group, kind); layers of one call kind
        run the same code with the same settings."""
        number, _, position = self.place(index)
        return number, position, self.kinds[index]

    def differing_settings(self, start: int, stop: int) -> list[str]:
        """The names of the settings that differ between layers start, ...,
        stop - 1 of one segment ('self_attn.sliding_window'), but for the
        per-layer attributes."""
        number, first, _ = self.place(start)
        stack = self.segments[number]
        if not isinstance(stack, SegmentStack):
            return []
        groups = range(first, first + (stop - start + self.plan[number].period - 1)
                       // self.plan[number].period)
        return sorted(path for path, values in stack.per_layer_values.items()
                      if path not in stack.watched_paths
                      and len({id(values[group]) if not isinstance(values[group], _PLAIN)
                               else (type(values[group]), values[group]) for group in groups}) > 1)

    def kinds_in_segment_of(self, index: int) -> int:
        """How many kinds of layers layer `index`'s segment holds."""
        segment = self.plan[self.place(index)[0]]
        return len(set(self.kinds[segment.start:segment.stop]))

    def layer(self, index: int) -> nn.Module:
        """Layer `index`, the module itself."""
        return self._modules[str(self._checked(index))]

    def built_layer(self, index: int) -> nn.Module:
        """Layer `index` as its segment's template builds it (a copy holding
        views of its slices and its settings, none of the attributes it set
        on itself in calls): what a dry run rehearses; a layer held as itself
        is itself."""
        number, group, position = self.place(self._checked(index))
        stored = self.segments[number]
        if not isinstance(stored, SegmentStack):
            return stored
        built = stored.built_layer(group)
        return built.layers[position] if self.plan[number].period > 1 else built

    def __getitem__(self, index):
        driver = traced_driver(self) if executor_of_call().traces_loops else None
        if driver is None:
            return self.item_at_graph_break(index)
        if isinstance(index, slice):
            return [TracedLayerCall(driver, each) for each in range(len(self))[index]]
        return self.layer(index)

    def __iter__(self):
        driver = traced_driver(self) if executor_of_call().traces_loops else None
        if driver is None:
            return self.iterator_at_graph_break()
        return iter([TracedLayerCall(driver, index) for index in range(len(self))])

    @at_graph_break
    def item_at_graph_break(self, index):
        if isinstance(index, slice):
            return [self._in_loop(each) for each in range(len(self))[index]]
        # Indexed in its owner's loop (`self.layers[i](...)`), a layer is a
        # call its driver runs, as iterated: the plan then says what the forward
        # does between the calls.
        return self._in_loop(self._checked(index))

    def _checked(self, index) -> int:
        """`index` as a layer's place in the list, from 0 (negative: from the end)."""
        index = operator.index(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"Layer index {index} is out of range for {len(self)} layers.")
        return index % len(self)

    @at_graph_break
    def iterator_at_graph_break(self):
        items = (self._in_loop(index) for index in range(len(self)))
        return items if active_driver(self) is None else iterated(self, items)

    def _in_loop(self, index: int):
        """Layer `index` as its owner's forward loop gets it: a `LayerCall`
        that its driver runs; anywhere else, the layer as a module."""
        driver = active_driver(self)
        return self.layer(index) if driver is None else loop_item(driver, index, self.layer)

    def unstacked(self) -> list[nn.Module]:
        """The layers, each given tensors of its own (copies of its slices);
        the stacks let them go."""
        for stack in self.stacks():
            stack.storage.release()
        return [self.layer(index) for index in range(len(self))]

    def unscannable(self) -> str | None:
        """Why no call can run these layers as a scan now, known without a
        call, or None: a subclass's rules (none here)."""
        return None

    def as_traced(self, leaves: list) -> list:
        """A call's argument leaves as a scan's trace of the layers gets them,
        for telling whether the layers compute alike (`kinds.program_of`): as
        they are; a subclass whose scan gives the layers stand-ins of some
        (a key/value cache) gives those."""
        return leaves

    def call_layer(self, index: int, args: tuple, kwargs: dict):
        """Layer `index`'s call, run by the layer itself (what it sets on
        itself is its state, no setting to read again)."""
        layer = self.layer(index)
        try:
            return self.run_layer(layer, args, kwargs)
        finally:
            self._settings_read.seen(self._checked(index), layer)

    def run_layer(self, layer: nn.Module, args: tuple, kwargs: dict):
        """Calls a layer module (a subclass's rules around the call)."""
        return layer(*args, **kwargs)

    def scan_run(self, run, hidden, args: tuple, kwargs: dict):
        """Runs `run` (a `planner.Run` of its layers) as one scan on
        `hidden`, each layer called with `args`/`kwargs` (a PerLayerChoice
        giving each layer its own; for a segment of groups, `calls`, each
        position's): an `execution.ScanResult`, or why it cannot (a Refusal),
        before anything ran. A subclass may run calls with arguments a scan
        cannot take as they are (a key/value cache) otherwise."""
        return scan_result(run, scan_runner.attempt(self.runner(run), hidden, args, kwargs))

    def runner(self, run) -> scan_runner.Layers:
        """The layers of `run` (a scan of the plan) as the runners take them:
        run by a template with the settings of the run's first layer (each
        group's positions by theirs; a run of groups of layers that one
        segment stores one by one, by a group of the positions' templates),
        with the numbers the run's layers differ in (`Run.numbers`)."""
        segment, stack = self.plan[run.segment], self.segments[run.segment]
        first, count = (run.start - segment.start) // segment.period, \
            (run.stop - run.start) // segment.period
        if run.period > segment.period:  # groups of layers of several kinds
            group = self._group_for(run.start, run.period)
            return stack.runner(first, count, group, positions=run.period)
        layers = stack.runner(first, count, self._template_for(run.start))
        return dataclasses.replace(layers, kept=run.kept[0] if any(run.kept) else layers.kept,
                                   numbers=run.numbers)

    def _group_for(self, start: int, period: int) -> LayerGroup:
        """A group of the templates of layers start, ..., start + period - 1
        (kept, so that its scans' traces are kept too)."""
        number = self.place(start)[0]
        stack = self.segments[number]
        copies = _KIND_TEMPLATES.setdefault(stack.template, {})
        key = ("group", tuple(self.kinds[start:start + period]),
               stack.layout_now().trace_key)
        if key not in copies:
            templates = []
            for index in range(start, start + period):
                template = self._template_for(index)
                # Two positions of one kind need modules of their own: one module
                # twice in the group would tie its tensors across the positions.
                templates.append(copy.deepcopy(template)
                                 if any(template is each for each in templates) else template)
            copies[key] = LayerGroup(templates)
        return copies[key]

    def _template_for(self, index: int) -> nn.Module:
        """The template that runs layer `index`'s code with its settings: its
        segment's own when the layer is of the kind of the segment's first
        layer, else a copy with the layer's settings (kept, so that its
        scans' traces are kept too)."""
        number, group, _ = self.place(index)
        segment, stack = self.plan[number], self.segments[number]
        first = index - (index - segment.start) % segment.period
        if all(self.kinds[first + position] == self.kinds[segment.start + position]
               for position in range(segment.period)):
            return stack.template
        copies = _KIND_TEMPLATES.setdefault(stack.template, {})
        # The template's settings are in the key: a copy made before they changed
        # (peft switching adapters) is stale.
        kinds = (tuple(self.kinds[first:first + segment.period]),
                 stack.layout_now().trace_key, self._settings_key)
        if kinds not in copies:
            template = copy.deepcopy(stack.template)
            for path, values in stack.per_layer_values.items():
                owner_path, _, name = path.rpartition(".")
                setattr(template.get_submodule(owner_path), name, values[group])
            copies[kinds] = template
        return copies[kinds]

    def extra_repr(self) -> str:
        return f"num_layers={len(self)}, segments={[str(each) for each in self.plan]}"


def stacking_refusal(layers: Iterable[nn.Module], **options) -> Refusal | None:
    """Why `StackedList(layers, **options)` refuses `layers`, as a value, or
    None when it stacks them; nothing is built. The constructor raises
    `refusal.exception()` from the same checks: each layer a module whose
    settings reach its own modules and tensors as its own (not through a
    function's closure or a weak reference, which copies share); and per
    segment, its layers (or groups) alike in structure with no parameter
    shared between two, the reason then starting with the segment ("layers
    0-3 (4 layers): ..."). A wrong option is the caller's mistake, raised
    here (TypeError or ValueError naming it), not a refusal."""
    split = _split(list(layers),
                   checked_stack_options("stacking_refusal", **options)["per_layer_attributes"])
    return split if isinstance(split, Refusal) else None


@dataclasses.dataclass(frozen=True)
class _Split:
    """A list of layers as a `StackedList` stores it: each layer's layout, the
    segments, and each segment's members (its layers, or its groups)."""
    layouts: list[LayerLayout]
    plan: tuple[Segment, ...]
    members: list[list[nn.Module]]


def _split(layers: list, per_layer_attributes: frozenset[str]) -> _Split | Refusal:
    """`layers` split into segments, each segment's stack checked as its
    constructor checks it (`alike.stackable_layers`); or the first refusal."""
    layouts = layouts_of(layers)
    if isinstance(layouts, Refusal):
        return layouts
    plan = plan_segments([structure_key(layout) for layout in layouts])
    members = []
    for segment in plan:
        segment_layers = layers[segment.start:segment.stop]
        if segment.period > 1:
            segment_layers = [LayerGroup(segment_layers[first:first + segment.period])
                              for first in range(0, len(segment_layers), segment.period)]
        if not segment.single:
            checked = stackable_layers(segment_layers, per_layer_attributes,
                                       SegmentStack.keeps_differing_settings, segment.start,
                                       segment.period, shared_parameters(segment_layers))
            if isinstance(checked, Refusal):
                return checked.within(str(segment))
        members.append(segment_layers)
    return _Split(layouts, plan, members)

