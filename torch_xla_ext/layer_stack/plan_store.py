"""The call plans of an owner's forward, one per kind of call.

`OwnerPlans.start` is what `owner_loops.drive_loops` asks at each forward of an
owner: the driver of each of its stacked lists' loops, an `Execution` of
the plan for this kind of call. A kind of call is what the plan can depend
on: the forward's arguments' form, the tensors' shapes and dtypes, the
constants, the classes of other objects, the owner's mode and settings,
whether gradients are computed, and whether `torch.export` traces. A kind
met for the first time is planned from a dry run (`dry_run`, `planner`),
run apart from an export's trace; later calls of that kind reuse the plan,
whose every call is checked as it runs (`executor`). Layers away from an
XLA device are planned to run one by one, with no dry run: the scan is an
XLA loop (under `torch.export`, torch's scan operator on any device); so are
layers whose stack says that no call can scan them now
(`StackedList.unscannable`: layers whose shapes depend on the data, which
the dry run's fakes cannot run either).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from torch_xla_ext.diagnostics import Refusal
from torch_xla_ext.layer_stack.planner import CallPlan, plan_calls
from torch_xla_ext.layer_stack.dry_run import record_calls
from torch_xla_ext.layer_stack.execution import Execution
from torch_xla_ext.layer_stack.executors import device_reason, executor_of_call
from torch_xla_ext.layer_stack.fakes import apart_from_trace
from torch_xla_ext.layer_stack.shared_mappings import is_shared_mapping
from torch_xla_ext.layer_stack.dynamo import (
    TracedExecution, TracedLoop, traced_loops, traced_runs, warn_graph_break)
from torch_xla_ext.object_graph import VALUE_TYPES
from torch_xla_ext.scan.cache import BoundedStore

__all__ = ["OwnerPlans"]


class OwnerPlans:
    """The plans of one owner's forward, by kind of call."""

    def __init__(self):
        # By kind of call: each stacked list's plan, and the stand-ins its
        # executions share; bounded like the scan cache, and cleared with it.
        self.plans = BoundedStore()  # kind -> {name: (CallPlan, stand-ins)}
        # By kind of call as Dynamo computes it (plain values, as Dynamo
        # hashes none of a call's TreeSpec or dtypes): each stacked list's
        # runs as Dynamo traces them, or why its loop runs at a graph break
        # (`dynamo`).
        self.traced_runs = BoundedStore()  # kind -> {name: TracedLoop | Refusal}
        # The names of the plain settings of the owner and of its config.
        self.setting_names: tuple[tuple[str, ...], tuple[str, ...]] | None = None

    def start(self, owner: nn.Module, names: tuple[str, ...], args: tuple, kwargs: dict
              ) -> dict[str, Execution]:
        stacks = {name: owner._modules[name] for name in names}
        device = next((tensor.device for stack in stacks.values()
                       for tensor in stack.parameters()), None)
        reason = next(filter(None, [None if device is None else device_reason(device),
                                    *(stack.unscannable() for stack in stacks.values())]), None)
        if reason is not None:
            return {name: Execution(stack, CallPlan((), reason)) for name, stack in stacks.items()}
        key = (_kind_of_call(owner, args, kwargs),
               tuple(stack.settings_key() for stack in stacks.values()))
        plans = self.plans.get(key)
        if plans is None:
            with apart_from_trace():
                record = record_calls(owner, stacks, args, kwargs)
            plans = {name: (plan_calls(stack, record.calls[name], record), {})
                     for name, stack in stacks.items()}
            self.plans.put(key, plans)
            if traced_loops() and executor_of_call().prepares_traced_loops:
                self._add_traced(owner, args, kwargs, {name: plan for name, (plan, _) in
                                                       plans.items()}, stacks, record)
        return {name: Execution(stacks[name], plan, stand_ins)
                for name, (plan, stand_ins) in plans.items()}

    def traced(self, owner: nn.Module, names: tuple[str, ...], args: tuple, kwargs: dict
               ) -> dict[str, TracedExecution] | None:
        """Under Dynamo: the drivers of this forward's loops as Dynamo traces
        them, or None when no eager call of this kind planned them or one
        cannot be traced (the loops then run at a graph break)."""
        if not traced_loops() or self.setting_names is None:
            return None
        runs = self.traced_runs.peek(_traced_kind(owner, args, kwargs, self.setting_names))
        if runs is None or not all(isinstance(each, TracedLoop) for each in runs.values()):
            return None
        return {name: TracedExecution(owner._modules[name], each) for name, each in runs.items()}

    def _add_traced(self, owner, args, kwargs, plans: dict, stacks: dict, record) -> None:
        if self.setting_names is None:
            self.setting_names = (_setting_names(owner),
                                  _setting_names(getattr(owner, "config", None)))
        with apart_from_trace():
            runs = {name: traced_runs(stacks[name], plan, record.calls[name],
                                      record.attributes_read[name])
                    for name, plan in plans.items()}
        kind = _traced_kind(owner, args, kwargs, self.setting_names)
        if kind in self.traced_runs:
            # Kinds of call that Dynamo's key does not tell apart: no traced runs for them.
            runs = {name: Refusal("it is called in kinds that differ in what Dynamo's key of a "
                                  "call (plain values) leaves out") for name in plans}
        self.traced_runs.put(kind, runs)
        for name, each in runs.items():
            if isinstance(each, Refusal):
                warn_graph_break(owner, name, each.reason)


def _traced_kind(owner: nn.Module, args: tuple, kwargs: dict,
                 setting_names: tuple[tuple[str, ...], tuple[str, ...]]) -> tuple:
    """The kind of call (`_kind_of_call`) of plain values only, which Dynamo
    computes and compares: the settings by the names an eager call found."""
    leaves, spec = tree_flatten((args, kwargs))
    config = getattr(owner, "config", None)
    return (str(spec), tuple(_plain_leaf_kind(leaf) for leaf in leaves), owner.training,
            torch.is_grad_enabled(), tuple(getattr(owner, name, None) for name in setting_names[0]),
            tuple(getattr(config, name, None) for name in setting_names[1]))


def _plain_leaf_kind(leaf) -> tuple:
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), str(leaf.dtype), str(leaf.device), leaf.requires_grad)
    if isinstance(leaf, VALUE_TYPES):
        return (type(leaf).__name__, leaf)
    return (type(leaf).__module__, type(leaf).__qualname__)


def _setting_names(obj) -> tuple[str, ...]:
    return tuple(name for name, _ in _settings(obj))


def _kind_of_call(owner: nn.Module, args: tuple, kwargs: dict) -> tuple:
    leaves, spec = tree_flatten((args, kwargs))
    # Each executor's calls are a kind of their own (an export's stand-ins are its trace's).
    return (spec, tuple(_leaf_kind(leaf) for leaf in leaves), owner.training,
            torch.is_grad_enabled(), executor_of_call(), _settings(owner),
            _settings(getattr(owner, "config", None)))


def _leaf_kind(leaf) -> tuple:
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
    if isinstance(leaf, VALUE_TYPES):
        return (type(leaf), leaf)
    if is_shared_mapping(leaf):  # which entries it holds can change what the layers do
        return (type(leaf), tuple((key, tuple(_leaf_kind(each) for each in tree_flatten(value)[0]))
                                  for key, value in leaf.items()))
    return (type(leaf),)


def _settings(obj) -> tuple:
    """The plain values among `obj`'s attributes (a module's flags, a config's settings)."""
    if obj is None or not hasattr(obj, "__dict__"):
        return ()
    return tuple((name, value) for name, value in vars(obj).items()
                 if isinstance(value, VALUE_TYPES))
