"""`StackedLayers`: what `stack_layers` puts in place of a transformers
model's layer list, a `layer_stack.StackedList` that knows what
transformers' layers are called with.

Its owner's forward runs its loop as the call plan says (`layer_stack`:
runs of layers as scans, each started at its first call); what is
transformers' own is how a run's scan takes the call:

* a key/value cache among the arguments runs as `cache_plan` plans it: one
  scan that records what the layers put in it, or writes its stacked
  buffers in place, else the layers one by one;
* calls that ask for each layer's output (`output_hidden_states`,
  `output_attentions`), which transformers collects with forward hooks on
  the layers, replay the hooks after the scan, once per layer;
* transformers' gradient checkpointing makes the scan recompute each layer
  (`checkpointing`); a layer that runs by itself keeps it, with torch_xla's
  checkpoint function on XLA;
* mixture-of-experts layers scan with the experts implementation of static
  shapes only (`experts`): with another, every call runs them one by one
  (`unscannable`, asked before any dry run, whose fakes cannot route tokens
  by data either);
* where one kind of layers gets no attention mask (SDPA's causal mask is
  theirs) and another a mask tensor, the None becomes the mask it stands
  for, so that each layer's mask is a tensor the scan picks.
"""
from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from torch_xla_ext.hf import checkpointing
from torch_xla_ext.diagnostics import Refusal
from torch_xla_ext.hf.cache_plan import plan_cache_call, starts_empty
from torch_xla_ext.hf.caches import is_cache, keeping_all
from torch_xla_ext.hf.discovery import is_capture_hook
from torch_xla_ext.hf.experts import experts_modules, experts_reason
from torch_xla_ext.layer_stack import (
    PerLayerChoice, SegmentStack, StackedList, attempt, attempt_recording, scan_result)

__all__ = ["PER_LAYER_OUTPUTS", "StackedLayers", "any_standing", "retire"]

# Output flags of transformers models that collect something from every layer.
PER_LAYER_OUTPUTS = ("hidden_states", "attentions")


# The stacks that stand in models: made, copied or unpickled, and not
# unstacked since; weakly, so that a model dropped with its stacks is gone.
_standing: "weakref.WeakSet[StackedLayers]" = weakref.WeakSet()


def any_standing() -> bool:
    """Whether a `StackedLayers` stands in a model (see `retire`)."""
    return len(_standing) > 0


def retire(stack: StackedLayers) -> None:
    """Records that `stack` no longer stands in a model: it was replaced by
    its layers."""
    _standing.discard(stack)


class StackedLayers(StackedList):
    """The layers of a transformers model's layer list, stacked (see the
    module docstring and `stack_layers`).

    Args:
      layers: the layers.
      config: the model's config, which the stacked layers read as the
        original ones did (changing it reaches them).
      recorded_outputs: what transformers' output-capturing hooks on the
        layers collect (`_can_record_outputs`' keys).
      options: passed to `StackedList`.
    """

    replays_hook = staticmethod(is_capture_hook)

    # Set by transformers' gradient_checkpointing_enable() and _disable() on
    # each module that has the attribute, as on its GradientCheckpointingLayers.
    gradient_checkpointing = False
    _gradient_checkpointing_func = None

    def __init__(self, layers: Iterable[nn.Module], config=None,
                 recorded_outputs: Iterable[str] = (), **options):
        layers = list(layers)
        super().__init__(layers, **options)
        self.model_config = config
        self.recorded_outputs = tuple(recorded_outputs)
        templates = []
        for segment, stored in zip(self.plan, self.segments):
            if isinstance(stored, SegmentStack):
                templates.append(stored.template)
                if config is not None:
                    _share_config(stored.template, layers[segment.start:segment.stop],
                                  segment.period, config)
        self.gradient_checkpointing, self._gradient_checkpointing_func = (
            checkpointing.taken_from(templates))
        # Found once: which implementation they run is read at every call.
        self.experts = tuple(module for stored in self.segments for module in experts_modules(
            stored.template if isinstance(stored, SegmentStack) else stored))
        _standing.add(self)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        _standing.add(self)  # a copy, or unpickled

    def settings_read(self) -> None:
        # Gradient checkpointing enabled on the layers (by transformers, after
        # converting) is the scan's policy, never a checkpoint inside the scan.
        enabled, function = checkpointing.taken_from(
            [stack.template for stack in self.stacks()])
        if enabled:
            self.gradient_checkpointing, self._gradient_checkpointing_func = True, function

    def layer(self, index: int) -> nn.Module:
        return checkpointing.given_to([super().layer(index)], self)[0]

    def unstacked(self) -> list[nn.Module]:
        return checkpointing.given_to(super().unstacked(), self)

    def unscannable(self) -> str | None:
        return experts_reason(self.experts) if self.experts else None

    def as_traced(self, leaves: list) -> list:
        """A key/value cache as one whose sliding-window layers are full-attention
        ones where they give back what those would (`caches.keeping_all`): a
        scan's recording gives each layer what it holds and the new keys and
        values, and leaves what a window keeps to the cache, after the loop."""
        if not leaves or not isinstance(leaves[0], torch.Tensor):
            return leaves
        new_tokens = leaves[0].shape[-2]
        return [keeping_all(leaf, new_tokens) if is_cache(leaf) else leaf for leaf in leaves]

    def run_layer(self, layer: nn.Module, args: tuple, kwargs: dict):
        device = next((leaf.device for leaf in tree_flatten((args, kwargs))[0]
                       if isinstance(leaf, torch.Tensor)), None)
        with checkpointing.runnable_on(layer, device):
            return layer(*args, **kwargs)

    def scan_run(self, run, hidden, args: tuple, kwargs: dict):
        layers = self.runner(run)
        calls = kwargs["calls"] if run.period > 1 else ((args, kwargs),)
        if self.gradient_checkpointing and self.training:
            layers = checkpointing.under_policy(self, layers)
        layers = dataclasses.replace(
            layers, hooks_replayed=_replays_per_layer_outputs(self, calls[-1][1]))
        calls = tuple(_explicit_attention_masks(args, kwargs, self.model_config, layers.template)
                      for args, kwargs in calls)
        caches = {id(leaf): leaf for leaf in tree_flatten(calls)[0] if is_cache(leaf)}
        if not caches:
            return scan_result(run, attempt(layers, hidden, *_call_of(calls, run.period)))
        named = [_cache_by_name(layers.template, run.period, hidden, call_args, call_kwargs)
                 for call_args, call_kwargs in calls]
        if len(caches) > 1 or any(found is None for found in named):
            return Refusal("the layers get more than one key/value cache, or one passed by "
                           "position past their named parameters, and a scan stands for one "
                           "passed by name")
        parameter, cache = named[0][0], next(iter(caches.values()))
        gradients = torch.is_grad_enabled() and (hidden.requires_grad or any(
            tensor.requires_grad for tensor in self.parameters()))
        plan = plan_cache_call(cache, parameter, run.stop - run.start, hidden.shape[-2],
                               hidden.device, gradients, first=run.start,
                               period=None if run.period == 1 else run.period)
        if isinstance(plan, Refusal):
            return plan
        without_cache = tuple((found[1], {name: value for name, value in found[2].items()
                                          if name != parameter}) for found in named)
        outcome = attempt_recording(layers, hidden, *_call_of(without_cache, run.period),
                                    plan.recording, state=plan.state)
        if isinstance(outcome, Refusal):
            return outcome
        last_hidden, recorded, kept, handed, found = outcome
        plan.commit(recorded, found, hidden.shape[-2])
        return scan_result(run, (last_hidden, kept, handed))


def _call_of(calls: tuple, period: int) -> tuple[tuple, dict]:
    """(args, kwargs) of a scan step: the one call's, or a group's calls."""
    return calls[0] if period == 1 else ((), {"calls": calls})


def _replays_per_layer_outputs(stack: StackedLayers, kwargs: dict) -> bool:
    """Whether the call asks for an output of every layer that transformers'
    hooks collect, which the scan then replays."""
    return any(_output_requested(stack.model_config, f"output_{name}", kwargs)
               for name in dict.fromkeys((*PER_LAYER_OUTPUTS, *stack.recorded_outputs))
               if name in stack.recorded_outputs)


def _output_requested(config, flag: str, kwargs: dict) -> bool:
    # As transformers decides: the call's flag, else the config's.
    return bool(kwargs[flag] if flag in kwargs else getattr(config, flag, False))


def _cache_by_name(template: nn.Module, period: int, hidden, args: tuple, kwargs: dict
                   ) -> tuple[str, tuple, dict] | None:
    """(the name of the cache's parameter, the call's other positional
    arguments, its keyword arguments with every argument bound to a
    parameter by name after the hidden state) of a layer call with a
    key/value cache (GPT-2 passes its cache by position); None when one is
    passed by position past the named parameters."""
    keywords = dict(kwargs)
    if args:
        layer = template if period == 1 else template.layers[0]
        signature = inspect.signature(type(layer).forward)
        bound = signature.bind(layer, hidden, *args, **kwargs)
        keywords = {}
        for name, value in list(bound.arguments.items())[2:]:  # after self and the hidden state
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                return None
            keywords.update(value if kind is inspect.Parameter.VAR_KEYWORD else {name: value})
    parameter = next((name for name, value in keywords.items() if is_cache(value)), None)
    return None if parameter is None else (parameter, (), keywords)


def _explicit_attention_masks(args: tuple, kwargs: dict, config, template: nn.Module
                              ) -> tuple[tuple, dict]:
    """The call with an `attention_mask` that is None for some layers and a
    tensor for others (a PerLayerChoice) given the mask the None stands for,
    so that every layer's mask is a tensor: transformers passes None where
    SDPA's own causal mask does the masking (none with one query), and eager
    attention masks nothing. Only where every layer attends to the call's own
    tokens (no cache, or an empty DynamicCache), so that the masks span the
    same keys; other calls, and other attention implementations, keep theirs."""
    mask = kwargs.get("attention_mask")
    if not (isinstance(mask, PerLayerChoice) and any(each is None for each in mask.variants)):
        return args, kwargs
    given = next((each for each in mask.variants if isinstance(each, torch.Tensor)), None)
    implementation = getattr(config, "_attn_implementation", None)
    caches = [leaf for leaf in tree_flatten((args, kwargs))[0] if is_cache(leaf)]
    if (given is None or implementation not in ("sdpa", "eager")
            or not all(starts_empty(cache) for cache in caches)
            or not all(getattr(module, "is_causal", True) for module in template.modules())):
        return args, kwargs
    *_, queries, keys = given.shape
    allowed = torch.ones(queries, keys, dtype=torch.bool, device=given.device)
    if implementation == "sdpa" and queries > 1:
        allowed = allowed.tril()  # as SDPA's is_causal, from the top left
    if given.dtype == torch.bool:
        explicit = allowed.expand(given.shape)
    else:
        explicit = torch.zeros(allowed.shape, dtype=given.dtype, device=given.device).masked_fill(
            ~allowed, torch.finfo(given.dtype).min).expand(given.shape)
    variants = tuple(explicit if each is None else each for each in mask.variants)
    return args, {**kwargs, "attention_mask": PerLayerChoice(variants, mask.choice)}


def _share_config(template: nn.Module, layers: list[nn.Module], period: int, config) -> None:
    """Points the template's references to `config` back at `config` itself,
    which the template's deep copy had copied (`layers`: the segment's, the
    first of which, or the first `period` of which in a group, it copies)."""
    originals = ({path: module for path, module in layers[0].named_modules()} if period == 1
                 else {f"layers.{position}.{path}".rstrip("."): module
                       for position, layer in enumerate(layers[:period])
                       for path, module in layer.named_modules()})
    for path, module in template.named_modules():
        original = originals.get(path)
        if original is None:
            continue
        for attribute, value in vars(original).items():
            if value is config:
                setattr(module, attribute, config)
