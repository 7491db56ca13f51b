"""The stacks that `stack_layers` puts in place of a transformers model's
decoder-layer list: `StackedLayers` (one scan: layers of one kind, or of
several kinds that differ only in the settings telling them apart),
`StackedLayerKinds` (kinds that differ in more, a few scans) and
`StackedAfterFirst` (a loop that hands what each layer returns back as the
next call's arguments: layer 0 as itself, the others as one scan); each runs a call with a
key/value cache as `torch_xla_ext.hf.cache_plan` plans it: scans where the
cache allows, else layer by layer."""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import operator
import re
import threading
from typing import Iterable, Sequence

import torch
from torch import nn

from torch_xla_ext.hf import checkpointing
from torch_xla_ext.hf.cache_plan import (
    CACHE_REASON, CachePlan, holds_nothing, plan_cache_call, starts_empty)
from torch_xla_ext.hf.caches import is_cache
from torch_xla_ext.hf.experts import experts_modules, experts_reason
from torch_xla_ext.layer_stack import LayerStack, optimizer_state
from torch_xla_ext.layer_stack.groups import GroupedLayers, LayerGroup
from torch_xla_ext.layer_stack.handed_on import handed_on, returned
from torch_xla_ext.layer_stack.kinds import KindCalls, kind_attributes
from torch_xla_ext.layer_stack.per_layer import DEFAULT_PER_LAYER_ATTRIBUTES
from torch_xla_ext.layer_stack.running import (
    Layers, Unscannable, run, run_layer_by_layer, run_recording, warn_layer_by_layer)


# Output flags of transformers models that collect something from every layer
# (`output_hidden_states`, `output_attentions`, ...): with transformers'
# output-capturing hooks (the stack's `recorded_outputs`), which a StackedLayers
# replays after its scan, else in the model's own loop, which calls the stack once.
PER_LAYER_OUTPUTS = ("hidden_states", "attentions")


class StackedLayers(LayerStack):
    """The decoder layers of a transformers model, stacked (see `stack_layers`).

    A `LayerStack` with what a transformers model's forward needs:

    * `layers[a:b]` covering all the layers is `[layers]`: the model's loop calls
      the stack once, which runs every layer as one scan, with the key/value
      cache passed to it as `torch_xla_ext.hf.cache_plan` says. Any other
      slice is the list of those layers;
      `layers[i]` and iteration give per-layer modules whose tensors are views of
      the stacked ones; iteration inside the forward of a model that iterates
      over its layers (GPT-2's `for block in self.h`) gives its loop's
      callables instead, the first of which runs the scan (`ForwardLoop`).
    * The template layer reads the model's own config object, so changing it
      (`model.config._attn_implementation = "eager"`, say) reaches the layers as
      it would reach the original ones.
    * Calls that ask for each layer's output (`output_hidden_states`,
      `output_attentions`, in the call or in the config) get the unconverted
      model's tuples from the same one scan: transformers collects them with
      forward hooks on each layer and its attention (`recorded_outputs`: the
      model's `_can_record_outputs`), which `stack_layers` installs before
      stacking; the scan's step records what the hooked modules get and
      return, stacked along the layers as its `ys`, and after the loop the
      hooks run once per layer on that layer's slice, as if each layer had
      been called (`torch_xla_ext.layer_stack.hooks`). Gradients flow through
      them. A call that runs layer by layer runs the hooks itself. A model
      that collects them in its own loop (no such hooks) is refused.
    * Layers of several `kinds` (`config.layer_types`: Gemma's sliding and full
      attention) that differ only in settings telling the kinds apart
      (`sliding_window`, ...) run as one scan too: the model's loop over
      `layers[: n]` then calls each layer with its kind's arguments (see
      `torch_xla_ext.layer_stack.kinds`), and the scan gives each layer its
      kind's, once the layer is shown to compute the same with each kind's
      settings (else the layers run one by one). Where transformers passes one
      kind's layers no attention mask (SDPA's causal mask, or none, is theirs)
      and another kind's a mask, the None becomes the mask it stands for.
    * transformers' gradient checkpointing, enabled before or after the
      conversion, makes the scan recompute each layer in its backward loop
      while training (see `torch_xla_ext.hf.checkpointing`); `layers[i]` and
      the unstacked layers carry it as transformers sets it.
    """

    # Set by transformers' gradient_checkpointing_enable() and _disable() on
    # each module that has the attribute, as on its GradientCheckpointingLayers.
    gradient_checkpointing = False
    _gradient_checkpointing_func = None

    def __init__(self, layers: Iterable[nn.Module], config=None,
                 recorded_outputs: Iterable[str] = (),
                 kinds: Sequence | None = None, **options):
        layers = list(layers)
        # The attributes that tell the kinds apart; each layer keeps its own.
        per_layer = options.get("per_layer_attributes", DEFAULT_PER_LAYER_ATTRIBUTES)
        self.__dict__["kind_attributes"] = (frozenset() if kinds is None
                                            else kind_attributes(layers, kinds, per_layer))
        if self.kind_attributes:
            options["per_layer_attributes"] = tuple(sorted({*per_layer, *self.kind_attributes}))
        super().__init__(layers, **options)
        self.mixed_kinds = kinds is not None
        # The calls of the model's loop, when it calls each layer (see __iter__).
        self.layer_kinds = KindCalls(kinds or [None] * len(layers)) if layers else None
        # 'path.attribute' of the settings that tell the kinds apart.
        self.__dict__["_kind_paths"] = tuple(
            path for path in self.per_layer_values
            if path.rpartition(".")[2] in self.kind_attributes)
        self.__dict__["_given_per_layer_attributes"] = tuple(sorted(per_layer))
        self.model_config = config
        self.recorded_outputs = tuple(recorded_outputs)
        # The slot of its first layer in the model's key/value cache: 1 for a
        # StackedAfterFirst's layers after the first.
        self.first_cache_layer = 0
        if config is not None and self._template is not None:
            _share_config(self._template, layers[0], config)
        # Mixture-of-experts modules, whose implementation decides whether a scan can run them.
        self.__dict__["_experts"] = () if self._template is None else experts_modules(self._template)
        if self._template is not None:
            self.gradient_checkpointing, self._gradient_checkpointing_func = (
                checkpointing.taken_from([self._template]))

    def __getitem__(self, index):
        if isinstance(index, slice) and range(len(self))[index] == range(len(self)):
            if self.mixed_kinds:
                return self._layer_calls()
            return [self]
        return super().__getitem__(index)

    def _layer_calls(self) -> list:
        """What a model's loop that calls each layer gets: a callable per layer
        (`_kind_call`)."""
        return [functools.partial(self._kind_call, each) for each in range(len(self))]

    def stack_options(self) -> dict:
        # The per-layer attributes as given: the kinds' own are found again.
        return {**super().stack_options(), "per_layer_attributes": self._given_per_layer_attributes}

    def _kind_call(self, index: int, hidden_states, *args, **kwargs):
        """Layer `index` of the model's loop: the call of the first layer of
        the last kind (of layer 0, for layers of one kind) runs them all, the
        others record or hand on the hidden state, after checking that it is
        what the previous call returned and that each layer gets its kind's
        arguments."""
        try:
            if not self.layer_kinds.record(index, hidden_states, args, kwargs):
                return hidden_states
            calls = _explicit_attention_masks(self.layer_kinds.calls(), self.model_config,
                                              self._template)
            args, kwargs = self.layer_kinds.merged(calls)
            return self.layer_kinds.ran(self(hidden_states, *args, **kwargs))
        finally:
            if index == len(self) - 1:
                self.layer_kinds.clear()

    def _layer(self, index, copied: bool) -> nn.Module:
        return checkpointing.given_to([super()._layer(index, copied)], self)[0]

    def _layers(self):
        layers = checkpointing.under_policy(self, super()._layers())
        if not self.mixed_kinds:
            return layers
        # The attributes that tell the kinds apart are read as the template's
        # (layer 0's); the scan stands for every kind once each kind's layer
        # is shown to compute the same.
        return dataclasses.replace(
            layers, per_layer_paths=tuple(path for path in layers.per_layer_paths
                                          if path not in self._kind_paths),
            kind_layers=self._kind_templates)

    def _kind_templates(self) -> tuple[nn.Module, ...]:
        """A copy of the template per kind, with that kind's settings."""
        firsts = [self.layer_kinds.kinds.index(kind) for kind in self.layer_kinds.order]
        templates = []
        for first in firsts:
            template = copy.deepcopy(self._template)
            for path in self._kind_paths:
                owner_path, _, name = path.rpartition(".")
                setattr(template.get_submodule(owner_path), name,
                        self.per_layer_values[path][first])
            templates.append(template)
        return tuple(templates)

    def __iter__(self):
        if _runs_the_loop(self):
            return iter(self._layer_calls())
        return super().__iter__()

    def forward(self, hidden_states, *args, **kwargs):
        hooks_replayed = _replays_per_layer_outputs(self, kwargs)
        if self._template is None:
            return hidden_states
        experts = experts_reason(self._experts)
        if experts is not None:
            return run_layer_by_layer(self.__getitem__, len(self), hidden_states, args, kwargs,
                                      drop_in=False, reason=experts)
        layers = dataclasses.replace(self._layers(), hooks_replayed=hooks_replayed)
        keywords = _with_cache_by_name(self._template, hidden_states, args, kwargs)
        if keywords is None:
            return run(layers, hidden_states, args, kwargs)
        parameter, cache = next((name, value) for name, value in keywords.items()
                                if is_cache(value))
        # Gradients to the layers' parameters, or to the hidden state (trainable
        # input embeddings of frozen layers).
        gradients = torch.is_grad_enabled() and (hidden_states.requires_grad or any(
            tensor.requires_grad for tensor in self.parameters()))
        plan = plan_cache_call(cache, parameter, len(self), hidden_states.shape[-2],
                               hidden_states.device, gradients, first=self.first_cache_layer)
        if isinstance(plan, CachePlan):
            without_cache = {name: value for name, value in keywords.items() if name != parameter}
            try:
                return _scan_with_cache(plan, layers, hidden_states, without_cache)
            except Unscannable as unscannable:
                plan = str(unscannable)
        return run_layer_by_layer(self.__getitem__, len(self), hidden_states, args, kwargs,
                                  drop_in=False, reason=plan)


class StackedLayerKinds(GroupedLayers):
    """The decoder layers of a transformers model whose `config.layer_types`
    mixes kinds that differ in more than the settings telling them apart
    (other submodules or shapes; Gemma2, Gemma3 and Qwen2's windows are one
    `StackedLayers`, see `torch_xla_ext.layer_stack.kinds`), stacked as a few scans by
    their pattern of kinds (see `torch_xla_ext.layer_stack.groups`): the
    model's loop `for i, layer in enumerate(self.layers[: n])` calls each
    layer with its kind's mask and rotary table, and each segment's layers
    run as one scan; a call with a key/value cache runs as
    `torch_xla_ext.hf.cache_plan` says (scans with an empty DynamicCache,
    else the layers one by one). Calls that ask for each layer's output
    (`output_hidden_states`, ...) get them from the scans, as StackedLayers'
    (each segment's scan replays the hooks of its groups' layers, group by
    group). Gradient checkpointing is as StackedLayers'."""

    # As StackedLayers'.
    gradient_checkpointing = False
    _gradient_checkpointing_func = None

    def __init__(self, layers: Iterable[nn.Module], kinds: list, config,
                 recorded_outputs: Iterable[str] = (), **options):
        layers = list(layers)
        super().__init__(layers, kinds, **options)
        self.model_config = config
        self.recorded_outputs = tuple(recorded_outputs)
        if config is not None:
            for segment, stack in zip(self.plan, self.segments):
                _share_config(stack._template,
                              LayerGroup(layers[segment.start:segment.start + segment.period]),
                              config)
        self.gradient_checkpointing, self._gradient_checkpointing_func = (
            checkpointing.taken_from([stack._template for stack in self.segments]))

    def __getitem__(self, index):
        layer = super().__getitem__(index)
        return layer if isinstance(index, slice) else checkpointing.given_to([layer], self)[0]

    def unstacked(self) -> list[nn.Module]:
        return checkpointing.given_to(super().unstacked(), self)

    def _run_segment(self, segment, stack, hidden, calls: tuple):
        layers = dataclasses.replace(
            checkpointing.under_policy(self, stack._layers()),
            hooks_replayed=_replays_per_layer_outputs(self, calls[-1][1]))
        caches = {(name, id(value)): value for _, kwargs in calls
                  for name, value in kwargs.items() if is_cache(value)}
        if not caches and not any(is_cache(value) for args, _ in calls for value in args):
            return run(layers, hidden, (), {"calls": calls})
        # A scan stands only for one cache, passed by name.
        named = [(name, cache) for (name, _), cache in caches.items()]
        parameter, cache = named[0] if len(named) == 1 else (None, None)
        # A segment's plan fills an empty cache, whatever the gradients.
        plan = plan_cache_call(cache, parameter, segment.stop - segment.start,
                               hidden.shape[-2], hidden.device, gradients=False,
                               first=segment.start, period=segment.period)
        if isinstance(plan, CachePlan):
            without_cache = tuple((args, {name: value for name, value in kwargs.items()
                                          if name != parameter}) for args, kwargs in calls)
            try:
                return _scan_with_cache(plan, layers, hidden, {"calls": without_cache})
            except Unscannable as unscannable:
                plan = str(unscannable)
        return run_layer_by_layer(lambda group: checkpointing.given_to([stack[group]], self)[0],
                                  segment.groups, hidden, (), {"calls": calls}, drop_in=False,
                                  reason=plan)


class StackedAfterFirst(nn.Module):
    """The layers of a model whose loop hands values each layer returns back
    as arguments of the next call (T5's `hidden_states, position_bias, ... =
    layer_module(hidden_states, mask, position_bias, ...)` then
    `position_bias = ...`; see `inspection.layer_loop`): layer 0, which gets
    what the forward set before the loop (None: it computes the values),
    runs as itself, and layers 1, ..., N-1, which get what layer 0 returned,
    as one scan of a `StackedLayers` (`rest`), those values entering the
    loop once, as arguments of every step.

    The model's loop gets a callable per layer (`ForwardLoop`): the first
    calls layer 0, the second runs the scan and returns what the last layer
    would (the hidden state, then the values a layer returns besides it,
    which `layer_stack.handed_on` shows to be the very arguments it got),
    the others return that again, after checking that they get that hidden
    state and the second call's very arguments (what the loop hands back).
    Where a layer returns a value it computes, or the call holds a
    key/value cache that holds tokens in the slots of layers 1, ..., N-1,
    each call runs its layer, with a LayerByLayerWarning; an empty one the
    scan fills (`cache_plan`, from slot 1 on).

    Like the other stacks: `len()`, `layers[i]` (layer 0 itself, the
    others holding views of their slices), iteration outside the loop,
    `state_dict()` with per-layer names (`0.layer.0...`, `1.layer.0...`),
    `unstacked()`; `named_parameters()` names layer 0's as they were
    (`block.0.layer.0.SelfAttention.q.weight`) and the others' stacked
    (`block.rest.stacked.layer.0.SelfAttention.q.weight`)."""

    def __init__(self, layers: Iterable[nn.Module], config=None,
                 recorded_outputs: Iterable[str] = (), **options):
        super().__init__()
        layers = list(layers)
        self.add_module("0", layers[0])
        self.rest = StackedLayers(layers[1:], config, recorded_outputs, **options)
        self.rest.first_cache_layer = 1
        # The calls of the model's loop to layers 1, ..., N-1; the second runs them.
        self._calls = KindCalls([None] * len(self.rest), first=1) if len(self.rest) else None
        self._given = None  # what layer 0 returned: the hidden state of the next call
        self._returned = None  # what the scan returned, or None when each call runs its layer
        self.register_state_dict_post_hook(_per_layer_state_dict)
        self.register_load_state_dict_post_hook(_per_layer_incompatible_keys)
        optimizer_state.track(self, inner=[self.rest])

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        optimizer_state.track(self, inner=[self.rest])  # a copy, or unpickled

    @property
    def first(self) -> nn.Module:
        return self._modules["0"]

    def __len__(self) -> int:
        return 1 + len(self.rest)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[each] for each in range(len(self))[index]]
        index = operator.index(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"Layer index {index} is out of range for {len(self)} layers.")
        index %= len(self)
        return self.first if index == 0 else self.rest[index - 1]

    def __iter__(self):
        if _runs_the_loop(self):
            return iter([functools.partial(self._called, each) for each in range(len(self))])
        return (self[index] for index in range(len(self)))

    def unstacked(self) -> list[nn.Module]:
        """Layer 0 itself, and the others as `LayerStack.unstacked` gives them."""
        return [self.first, *self.rest.unstacked()]

    def stack_options(self) -> dict:
        return self.rest.stack_options()

    def layer_parameters(self) -> list[tuple[str, int | None, str]]:
        """As `LayerStack.layer_parameters`: layer 0's parameters as they are, then the others'."""
        return [*((f"0.{name}", None, f"0.{name}") for name, _ in self.first.named_parameters()),
                *((f"rest.{stacked}", layer, _after_first(per_layer))
                  for stacked, layer, per_layer in self.rest.layer_parameters())]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        # Layers 1, ..., N-1's keys as the rest's, which it then loads; keys of
        # layers beyond len(self) stay, reported as unexpected.
        for key in [key for key in state_dict if key.startswith(prefix)]:
            index, dot, name = key[len(prefix):].partition(".")
            if index.isdigit() and 1 <= int(index) < len(self):
                state_dict[f"{prefix}rest.{int(index) - 1}{dot}{name}"] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)

    def _called(self, index: int, hidden_states, *args, **kwargs):
        """Layer `index` of the model's loop, called in order (see the class docstring)."""
        try:
            if index == 0:
                with checkpointing.runnable_on(self.first, hidden_states.device):
                    output = self.first(hidden_states, *args, **kwargs)
                self._given = _hidden_of(output)
                return output
            if index == 1:
                if hidden_states is not self._given:
                    raise RuntimeError(
                        f"layer 1 got another hidden state than layer 0 returned: layers 1-"
                        f"{len(self) - 1} run as one scan when layer 1 is called, on what layer 0 "
                        f"returned; call the layers in order, with nothing between them but "
                        f"handing back what each returned.")
                self._returned = self._run_rest(hidden_states, args, kwargs)
            if self._returned is None:
                return self.rest[index - 1](hidden_states, *args, **kwargs)
            # The later calls must get what the scan returned, and the arguments it used.
            if self._calls.record(index - 1, hidden_states, args, kwargs):
                self._calls.ran(_hidden_of(self._returned))
            return self._returned
        finally:
            if index == len(self) - 1:
                if self._calls is not None:
                    self._calls.clear()
                self._given = self._returned = None

    def _run_rest(self, hidden_states, args: tuple, kwargs: dict):
        """Layers 1, ..., N-1 as one scan: what the last one returns; None,
        with a LayerByLayerWarning, when each call is to run its layer."""
        stack = self.rest
        if any(is_cache(value) and not holds_nothing(value, stack.first_cache_layer, len(stack))
               for value in kwargs.values()):
            warn_layer_by_layer(len(stack), f"the layers after the first: {CACHE_REASON}",
                                stacklevel=4)
            return None
        # An empty key/value cache among the arguments is filled by each layer, never handed
        # on: the layers return what they would without it.
        without_cache = {name: value for name, value in kwargs.items() if not is_cache(value)}
        found = handed_on(stack._template, stack._stacked_tensors(), hidden_states, args,
                          without_cache)
        if isinstance(found, str):
            warn_layer_by_layer(len(stack), f"the layers after the first: {found}", stacklevel=4)
            return None
        return returned(found, stack(hidden_states, *args, **kwargs), args, without_cache)


def _hidden_of(output):
    """A layer's hidden state: its output, or the first value of its tuple."""
    return output[0] if isinstance(output, tuple) else output


def _after_first(name: str) -> str:
    """'2.mlp.weight' of layers 1, ..., N-1 as the name in the whole list, '3.mlp.weight'."""
    index, dot, rest = name.partition(".")
    return f"{int(index) + 1}{dot}{rest}"


# 'rest.3.layer...' of a StackedAfterFirst's state_dict, relative to it.
_REST_NAME = re.compile(r"rest\.(\d+)(\.|$)")


def _per_layer_state_dict(stack: StackedAfterFirst, state_dict, prefix: str,
                          local_metadata) -> None:
    """state_dict post-hook: layers 1, ..., N-1 by their names in the whole list."""
    for key in [key for key in state_dict if key.startswith(prefix + "rest.")]:
        state_dict[prefix + _after_first(key[len(prefix) + len("rest."):])] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [key for key in metadata
                    if key == prefix + "rest" or key.startswith(prefix + "rest.")]:
            entry = metadata.pop(key)
            if _REST_NAME.match(key[len(prefix):]):
                metadata[prefix + _after_first(key[len(prefix) + len("rest."):])] = entry


def _per_layer_incompatible_keys(stack: StackedAfterFirst, incompatible_keys) -> None:
    """load_state_dict post-hook: reports keys by their names in the whole list."""
    for keys in incompatible_keys:
        keys[:] = [re.sub(r"(^|\.)rest\.(\d+)(?=\.|$)",
                          lambda match: f"{match.group(1)}{int(match.group(2)) + 1}", key)
                   for key in keys]


def _scan_with_cache(plan: CachePlan, layers: Layers, hidden, kwargs: dict):
    """One scan over `layers` called with `kwargs` and each with the cache
    `plan` gives it; the plan's cache then holds what the layers' own
    updates would have left in it. Raises Unscannable (the cache unchanged
    but for being stacked) for a call that one scan cannot stand for."""
    hidden_states, recorded = run_recording(layers, hidden, (), kwargs, plan.recording,
                                            state=plan.state)
    plan.commit(recorded, hidden.shape[-2])
    return hidden_states


# The stacks that stack_layers makes.
STACKS = (StackedLayers, StackedLayerKinds, StackedAfterFirst)


@dataclasses.dataclass(frozen=True)
class LoopGuard:
    """A statement of an owner's loop over its layers that does something
    only while `test`, an expression of the owner's settings, holds (BART's
    LayerDrop: `if self.training and self.layerdrop > 0.0:`, which skips
    layers at random): found by `inspection.layer_loop`, evaluated on the
    owner at each forward. While it holds, the layers run one by one, as the
    loop calls them; a scan runs every layer."""
    where: str  # 'Owner.forward'
    line: str  # file:line
    text: str  # the statement's first line
    test: str

    @functools.cached_property
    def _code(self):
        return compile(self.test, self.line, "eval")

    def reason(self, owner: nn.Module) -> str | None:
        """Why the layers run one by one in this forward of `owner`, or None."""
        if not eval(self._code, {"__builtins__": {}}, {"self": owner}):
            return None
        return (f"{self.where} loops over its layers under `{self.text}` ({self.line}), "
                f"which holds, so that the loop may skip layers or do more between two (LayerDrop "
                f"while training skips layers at random), which one scan cannot; make it false "
                f"to run them as one scan (for LayerDrop, set the config's encoder_layerdrop and "
                f"decoder_layerdrop to 0.0)")


@dataclasses.dataclass(frozen=True)
class _Loop:
    forward_loop: ForwardLoop
    stack_id: int
    guarded: str | None  # why the layers run one by one in this forward (a guard holds)


class _RunningLoops(threading.local):
    """The forward loops running in this thread, innermost last."""

    def __init__(self):
        self.loops: list[_Loop] = []

    def over(self, stack: nn.Module) -> _Loop | None:
        return next((loop for loop in reversed(self.loops) if loop.stack_id == id(stack)), None)


_LOOPING = _RunningLoops()


def _runs_the_loop(stack: nn.Module) -> bool:
    """Whether iterating over `stack` now is its owner's forward loop, which
    gets the stack's callables (a scan stands for it); else the layers as
    modules: anywhere else (user code, peft, ...), and in that loop while one
    of its guards holds, with a LayerByLayerWarning giving the guard's reason."""
    loop = _LOOPING.over(stack)
    if loop is not None and loop.guarded is not None:
        warn_layer_by_layer(len(stack), loop.guarded, stacklevel=4)
    return loop is not None and loop.guarded is None


class ForwardLoop:
    """The forward hooks by which a module whose forward iterates over its
    stacked layer list `name` (`for block in self.h`, GPT-2's; see
    `inspection.layer_loop`) tells the stack so: while that forward runs,
    iterating over the stack gives the loop's callables (the first runs the
    scan, the others hand the hidden state on), or, while one of the loop's
    `guards` holds, the layers as modules; anywhere else (user code, peft,
    ...), the layers as modules."""

    def __init__(self, name: str, guards: tuple[LoopGuard, ...]):
        self.name = name
        self.guards = guards

    def entered(self, owner: nn.Module, args) -> None:
        guarded = next(filter(None, (guard.reason(owner) for guard in self.guards)), None)
        _LOOPING.loops.append(_Loop(self, id(owner._modules.get(self.name)), guarded))

    def left(self, owner: nn.Module, args, output) -> None:
        # Its last entry: `entered` may not have run (an earlier pre-hook raised).
        for index in range(len(_LOOPING.loops) - 1, -1, -1):
            if _LOOPING.loops[index].forward_loop is self:
                del _LOOPING.loops[index]
                return


def hook_forward_loop(owner: nn.Module, name: str, guards: tuple[LoopGuard, ...]) -> None:
    """Installs `ForwardLoop`'s hooks on `owner` for its layer list `name`
    (the `left` one runs even if the forward raises), in place of any it has."""
    unhook_forward_loop(owner, name)
    loop = ForwardLoop(name, guards)
    owner.register_forward_pre_hook(loop.entered)
    owner.register_forward_hook(loop.left, always_call=True)


def unhook_forward_loop(owner: nn.Module, name: str) -> None:
    """Removes the hooks `hook_forward_loop(owner, name)` installed, if any."""
    for hooks in (owner._forward_pre_hooks, owner._forward_hooks):
        for key, hook in list(hooks.items()):
            loop = getattr(hook, "__self__", None)
            if isinstance(loop, ForwardLoop) and loop.name == name:
                del hooks[key]
                owner._forward_hooks_always_called.pop(key, None)


def _replays_per_layer_outputs(stack: nn.Module, kwargs: dict) -> bool:
    """Whether the call asks for every layer's output (`output_hidden_states`,
    ...), which transformers' hooks collect and the scan then replays; raises
    if it asks for one that the model collects in its own loop, which calls
    the stack once."""
    requested = [name for name in dict.fromkeys((*PER_LAYER_OUTPUTS, *stack.recorded_outputs))
                 if _output_requested(stack.model_config, f"output_{name}", kwargs)]
    own_loop = [name for name in requested if name not in stack.recorded_outputs]
    if own_loop:
        flags = ", ".join(f"output_{name}" for name in own_loop)
        raise ValueError(
            f"stack_layers: the call asks for every decoder layer's output ({flags}), but the "
            f"model collects them in its own loop (not with transformers' output-capturing "
            f"hooks, which the stack replays), and that loop calls the stack once. Call the "
            f"model without {flags} (and set it to False in model.config), or use a model "
            f"that stack_layers did not convert for this call.")
    return bool(requested)


def _output_requested(config, flag: str, kwargs: dict) -> bool:
    # As transformers decides: the call's flag, else the config's.
    return bool(kwargs[flag] if flag in kwargs else getattr(config, flag, False))


def _with_cache_by_name(template: nn.Module, hidden_states, args: tuple, kwargs: dict
                        ) -> dict | None:
    """The call's arguments after the hidden state, each by its parameter's name
    (GPT-2 passes its cache by position), when one of them is a key/value
    cache; else None."""
    if not any(is_cache(value) for value in (*args, *kwargs.values())):
        return None
    if not args:
        return dict(kwargs)
    signature = inspect.signature(type(template).forward)
    bound = signature.bind(template, hidden_states, *args, **kwargs)
    keywords = {}
    for name, value in list(bound.arguments.items())[2:]:  # after self and the hidden state
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            return None  # positional past the named ones: left to the layer-by-layer path
        keywords.update(value if kind is inspect.Parameter.VAR_KEYWORD else {name: value})
    return keywords


def _explicit_attention_masks(calls: list, config, template: nn.Module) -> list:
    """The kinds' calls, with an `attention_mask` of None replaced by the mask
    it stands for when another kind's call has a mask tensor, so that the
    calls differ in tensors only: transformers passes None where SDPA's own
    causal mask does the masking (none with one query), and eager attention
    masks nothing. Only where every layer attends to the call's own tokens
    (no cache, or an empty DynamicCache), so that the kinds' masks span the
    same keys; other calls, and other attention implementations, keep theirs."""
    masks = [kwargs.get("attention_mask", False) for _, kwargs in calls]
    given = next((mask for mask in masks if isinstance(mask, torch.Tensor)), None)
    implementation = getattr(config, "_attn_implementation", None)
    caches = [value for args, kwargs in calls for value in (*args, *kwargs.values())
              if is_cache(value)]
    if (given is None or not any(mask is None for mask in masks)
            or implementation not in ("sdpa", "eager")
            or not all(starts_empty(cache) for cache in caches)
            or not all(getattr(module, "is_causal", True) for module in template.modules())):
        return calls
    *_, queries, keys = given.shape
    allowed = torch.ones(queries, keys, dtype=torch.bool, device=given.device)
    if implementation == "sdpa" and queries > 1:
        allowed = allowed.tril()  # as SDPA's is_causal, from the top left
    if given.dtype == torch.bool:
        explicit = allowed.expand(given.shape)
    else:
        explicit = torch.zeros(allowed.shape, dtype=given.dtype, device=given.device).masked_fill(
            ~allowed, torch.finfo(given.dtype).min).expand(given.shape)
    return [(args, {**kwargs, "attention_mask": explicit}) if mask is None else (args, kwargs)
            for (args, kwargs), mask in zip(calls, masks)]


def _share_config(template: nn.Module, layer: nn.Module, config) -> None:
    """Points the template's references to `config` back at `config` itself,
    which the template's deep copy had copied."""
    originals = dict(layer.named_modules())
    for path, module in template.named_modules():
        for attribute, value in vars(originals[path]).items():
            if value is config:
                setattr(module, attribute, config)
