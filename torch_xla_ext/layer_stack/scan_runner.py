"""Running a stack of layers: one scan over their stacked tensors (`run`), the
same handing out what each layer recorded (`run_recording`), the HLO of that
scan without running it (`lower`), and the for loop itself
(`run_layer_by_layer`) for a call that one trace cannot stand for. A stack
whose `Layers.hooks_replayed` is set runs its layers' forward hooks after the
loop, once per layer (see `hooks`). While `torch.export` traces, the scan
is one call of torch's scan operator instead, on any device (`executors`)."""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from typing import Any, Callable, Hashable

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from torch_xla_ext.layer_stack.alike import LayerLayout
from torch_xla_ext.layer_stack.executors import device_reason, executor_of_call
from torch_xla_ext.layer_stack.hooks import (
    RetainedGradients, hooks_held, replay, unreplayable)
from torch_xla_ext.layer_stack.kinds import call_for_layer, hidden_of
from torch_xla_ext.layer_stack.lifted_numbers import LiftedNumbers, substituting, unmatched
from torch_xla_ext.layer_stack.operands import (
    Unscannable, choice_tensor, leaves_in_step, split_arguments, traced_with)
from torch_xla_ext.layer_stack.sharding import entering
from torch_xla_ext.layer_stack.shared_mappings import holding
from torch_xla_ext.layer_stack.per_layer import (
    INDEX_ARGUMENT, OpaqueValue, read_refusal, reads_recorded_in, reads_watched)
from torch_xla_ext.scan import Lowered, StepCotangents, lower as lower_scan
from torch_xla_ext.diagnostics import Refusal, TorchXlaExtWarning


class LayerByLayerWarning(TorchXlaExtWarning):
    """A LayerStack or scan_layers call ran its layers one by one, as the for loop
    does, instead of as one scan; the message says why."""


@dataclasses.dataclass(frozen=True)
class Layers:
    """A stack of layers as the runners take it."""
    template: nn.Module  # whose code runs for every layer, on each layer's tensors
    layout: LayerLayout  # the template's current layout
    stacked_tensors: dict[str, torch.Tensor]  # name -> [num_layers, ...]
    per_layer_paths: tuple[str, ...]  # 'path.attribute' of the per-layer attributes that differ
    layer_at: Callable[[int], nn.Module]  # layer i, for running layer by layer
    num_layers: int
    # As torch_xla's scan_layers: a tuple hidden state is the layer's positional
    # arguments, and the layer's whole output is the next layer's input.
    drop_in: bool
    partition_fn: Any
    is_layer_pure: Any
    unroll: int | bool  # layers per iteration of the scan's loop (`scan`'s unroll)
    # Layers per scan step taken from consecutive slices of the stacked
    # tensors (the template is a group of that many layers, each reading its
    # slice of a step's `[positions, ...]`), else 0: one layer a step.
    positions: int = 0
    # FSDPv2's output sharding of a unit, when FSDPv2 wraps the stack: the
    # mesh and the partition spec of the hidden state (see `sharding.entering`).
    unit_output: tuple | None = None
    # Whether the template's forward hooks run after the loop, once per layer
    # on what the layer's hooked modules got and returned (see `hooks`),
    # rather than inside the trace.
    hooks_replayed: bool = False
    # The leaves of a layer's output (its `tree_flatten` leaves) that the
    # scan stacks along the layers as well (what a model's own loop keeps
    # of every layer: its hidden states, its attention weights).
    kept: tuple[int, ...] = ()
    # The Python numbers that differ between the layers, which the scan takes
    # per layer and each step puts in its layer's arithmetic (`lifted_numbers`).
    numbers: LiftedNumbers | None = None
    # Parameters every layer holds as one tensor, by the template's name: the
    # scan carries them unchanged, each step's layer reads them, and their
    # gradient is the sum over the layers, as for one parameter used L times.
    shared_tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Recording:
    """Objects that each traced layer call gets as keyword arguments, made
    afresh for the call (a key/value cache that records what the layer puts
    in it), and the tensors the call recorded in them, which the loop stacks
    along the layers. Inside such a call, the layer may hand its per-layer
    attributes on (`cache.update(k, v, self.layer_idx)`) but not use them."""
    key: Hashable  # tells recordings apart: the steps made for them differ
    # The keyword arguments of one layer call, from the layer's index (a 0-d
    # tensor) and the state tensors the call may write in place.
    make: Callable[[torch.Tensor, tuple], dict]
    recorded: Callable[[dict], tuple]  # the tensors recorded in them by the call
    # What the call left in them besides tensors (flags, sizes, the calls it
    # made), alike at every layer: found when the step is traced and kept
    # with the step, since a call whose trace the scan's cache holds runs no
    # layer code (`run_recording` hands it on).
    found: Callable[[dict], Any] | None = None


def run(layers: Layers, hidden, args: tuple, kwargs: dict):
    """Runs the layers in order on `hidden`, each called with `args`/`kwargs`,
    as one scan; returns the last hidden state. A call that one trace cannot
    stand for runs layer by layer, with a LayerByLayerWarning saying why.

    The tensors among `args`/`kwargs` ride along in the carry unchanged, so they
    reach the layers as loop inputs and gradients flow back to them. A
    `kinds.PerLayerChoice` among them gives each layer its own variant: the
    variants, tensors of one shape and dtype, ride along stacked, and each
    step picks its layer's."""
    outcome = attempt(layers, hidden, args, kwargs)
    if isinstance(outcome, Refusal):
        return run_layer_by_layer(layers.layer_at, layers.num_layers, hidden, args, kwargs,
                                  layers.drop_in, outcome.reason)
    return outcome[0]


def attempt(layers: Layers, hidden, args: tuple, kwargs: dict):
    """`run`'s scan: (the last hidden state, the kept output leaves stacked
    along the layers, the last layer's output leaves that HandedOn arguments
    take, by number), or
    why one scan cannot stand for the loop (a Refusal), before anything ran."""
    def scanned(step, init, xs):
        retained = RetainedGradients() if layers.hooks_replayed else None
        (last_hidden, _, handed), (_, calls, kept) = _loop(layers, retained)(step, init, xs)
        _replay_hooks(layers, calls, retained)
        return last_hidden, kept, handed

    refusal = _device_refusal_of(hidden)
    if refusal is not None:
        return refusal
    try:
        return _through_scan(layers, hidden, args, kwargs, scanned)
    except Unscannable as unscannable:
        return unscannable.refusal


def _device_refusal_of(hidden) -> Refusal | None:
    reason = next(filter(None, (device_reason(leaf.device) for leaf in tree_flatten(hidden)[0]
                                if isinstance(leaf, torch.Tensor))), None)
    return None if reason is None else Refusal(reason)


def _loop(layers: Layers, retained: RetainedGradients | None) -> Callable:
    """`scan(step, init, xs) -> (carry, ys)` with the stack's options, as the
    call's executor runs it; its backward gives `retained` (there with
    replayed hooks) the steps' cotangents of the calls they recorded (the
    second of the step's ys)."""
    step_cotangents = (None if retained is None else
                       StepCotangents(retained.wanted, lambda ys: retained.receive(ys[1])))
    return executor_of_call().loop(layers.partition_fn, layers.is_layer_pure, layers.unroll,
                                   step_cotangents)


def run_recording(layers: Layers, hidden, args: tuple, kwargs: dict, recording: Recording,
                  state: tuple[torch.Tensor, ...] = ()):
    """`run` with `recording`'s keyword arguments given to every layer: returns
    the last hidden state, the recorded tensors and the kept output leaves,
    each stacked [num_layers, ...], the last layer's output leaves that
    HandedOn arguments take, by number, and what `recording.found` gave when
    the step was traced (None without it). The layers may write the `state` tensors (a key/value cache stacked
    along the layers, say) in place, through what `recording` gives them:
    state is a carry of the loop, so XLA writes it in place, a few positions
    at a time, and after the call `state` holds what the loop left. Raises
    Unscannable for a call that one trace cannot stand for; the caller then
    runs the layers one by one with what they record into."""
    def scanned(step, init, xs):
        retained = RetainedGradients() if layers.hooks_replayed else None
        (last_hidden, _, handed, final_state), (recorded, calls, kept) = _loop(
            layers, retained)(step, (*init, state), xs)
        for tensor, final in zip(state, final_state):
            if final is not tensor:  # a read-only state leaves the loop as itself
                tensor.copy_(final)
        _replay_hooks(layers, calls, retained)
        return last_hidden, recorded, kept, handed, step.found_when_traced.get("found")

    return _through_scan(layers, hidden, args, kwargs, scanned, recording, state)


def attempt_recording(layers: Layers, hidden, args: tuple, kwargs: dict, recording: Recording,
                      state: tuple[torch.Tensor, ...] = ()):
    """`run_recording`, or why one scan cannot stand for the loop (a
    Refusal), before anything ran (the state unchanged)."""
    refusal = _device_refusal_of(hidden)
    if refusal is not None:
        return refusal
    try:
        return run_recording(layers, hidden, args, kwargs, recording, state)
    except Unscannable as unscannable:
        return unscannable.refusal


def lower(layers: Layers, hidden, args: tuple, kwargs: dict, device_kind: str) -> Lowered:
    """The HLO of the scan that `run` would run, staged for `device_kind`;
    nothing runs. Raises ValueError for a call that would run layer by layer."""
    def lowered(step, init, xs):
        return lower_scan(step, init, xs, partition_fn=layers.partition_fn,
                          is_fn_pure=layers.is_layer_pure, unroll=layers.unroll,
                          device_kind=device_kind)

    try:
        return _through_scan(layers, hidden, args, kwargs, lowered)
    except Unscannable as reason:
        raise ValueError(f"lower: this call would run the {layers.num_layers} layers one by "
                         f"one, not as one scan, so there is no scan to lower: {reason}") from None


def run_layer_by_layer(layer_at: Callable[[int], nn.Module], num_layers: int, hidden,
                       args: tuple, kwargs: dict, drop_in: bool, reason: str):
    """The for loop that a stack stands for, with a LayerByLayerWarning giving
    `reason`; each layer gets its variant of each PerLayerChoice argument."""
    warn_layer_by_layer(num_layers, reason, stacklevel=4)
    for index in range(num_layers):
        hidden = _next_hidden(layer_at(index), hidden, *call_for_layer(args, kwargs, index),
                              drop_in)
    return hidden


def warn_layer_by_layer(num_layers: int, reason: str, stacklevel: int) -> None:
    """The LayerByLayerWarning of a call whose layers run one by one."""
    warnings.warn(f"The {num_layers} layers ran one by one, as the for loop does, instead "
                  f"of as one scan: {reason}.", LayerByLayerWarning, stacklevel=stacklevel)


def _replay_hooks(layers: Layers, calls: list | None,
                  retained: RetainedGradients | None) -> None:
    """The template's forward hooks, once per layer, on what the scan's
    steps recorded (`calls`: None unless `layers.hooks_replayed`)."""
    if calls is not None:
        replay(layers.template, calls, layers.num_layers, retained)


# Per template layer, the scan steps made for it, one per trace key, each with
# the per-layer attributes its traces read. `scan` caches its trace on the
# step's identity, so each combination of layer settings and constant call
# arguments keeps its own step.
_STEPS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()

def _through_scan(layers: Layers, hidden, args: tuple, kwargs: dict,
                  stage: Callable[[Callable, tuple, Any], Any], recording: Recording | None = None,
                  state: tuple = ()):
    """`stage(step, init, xs)` for the scan step that runs one layer, its
    initial carry and what it scans over (the stacked tensors, with a
    recording each layer's index, and each PerLayerChoice's per-layer
    choice); raises Unscannable when the scan cannot stand for the loop. The
    carry is the hidden state, the tensor arguments, the HandedOn arguments'
    values (and a recording's state)."""
    _check_carried(hidden, "input_data" if layers.drop_in else "hidden")
    unreplayed = unreplayable(layers.template) if layers.hooks_replayed else None
    if unreplayed is not None:
        raise Unscannable(unreplayed)
    tensor_arguments, handed, arguments, choices, mappings = split_arguments(args, kwargs)
    key = (layers.layout.trace_key, arguments, layers.drop_in,
           recording.key if recording else None, layers.hooks_replayed, layers.kept,
           layers.positions, None if layers.numbers is None else layers.numbers.key(),
           layers.per_layer_paths)
    steps = _STEPS.setdefault(layers.template, {})
    if key not in steps:
        reads = set()
        steps[key] = (_make_step(weakref.ref(layers.template), arguments, layers.drop_in, reads,
                                 recording, layers.hooks_replayed, layers.kept,
                                 layers.positions, layers.numbers, layers.per_layer_paths), reads)
    step, reads = steps[key]
    refusal = reads and read_refusal(reads, layers.per_layer_paths)  # what its trace read
    if refusal:
        raise Unscannable(refusal)
    device = _device_of(hidden)
    xs = {"tensors": layers.stacked_tensors}
    if recording is not None:
        xs["index"] = torch.arange(layers.num_layers, device=device)
    if choices:
        xs["choices"] = [choice_tensor(choice, device) for choice in choices]
    if layers.numbers is not None:
        xs["numbers"] = layers.numbers.stacked(device)
    with traced_with(mappings):
        return stage(step, (entering(layers.unit_output, hidden),
                            (tensor_arguments, layers.shared_tensors), handed), xs)


def _device_of(hidden) -> torch.device:
    return tree_flatten(hidden)[0][0].device


def _check_carried(hidden, name: str) -> None:
    """Raises Unscannable unless every leaf of `hidden` is a tensor, as a scan carry's."""
    for path, leaf in tree_flatten_with_path(hidden)[0]:
        if not isinstance(leaf, torch.Tensor):
            raise Unscannable(f"{name}{keystr(path)} is of type {type(leaf).__name__}, and "
                               f"what goes from layer to layer in a scan must be tensors")


def _next_hidden(layer: Callable, hidden, args: tuple, kwargs: dict, drop_in: bool):
    """One iteration of the loop that the layers stand for."""
    if drop_in:
        return layer(*hidden) if isinstance(hidden, tuple) else layer(hidden)
    output = layer(hidden, *args, **kwargs)
    # A layer returns the hidden state, or a tuple that starts with it (transformers).
    return hidden_of(output)


def _make_step(template_ref: weakref.ref, arguments: tuple, drop_in: bool, reads: set,
               recording: Recording | None, hooks_replayed: bool, kept: tuple[int, ...],
               positions: int, numbers: LiftedNumbers | None, per_layer_paths: tuple[str, ...]):
    spec, constants = arguments

    def run_one_layer(carry, x):
        # With a recording, the carry ends with the state tensors, and each
        # step also gets its layer's index.
        hidden, (tensor_arguments, shared), handed, *with_state = carry
        layer_tensors, index = x["tensors"], x.get("index")
        if positions:
            layer_tensors = {f"layers.{position}.{name}": tensor[position]
                             for name, tensor in layer_tensors.items()
                             for position in range(positions)}
        layer_tensors = {**layer_tensors, **shared}
        leaves, filled = leaves_in_step(constants, tensor_arguments, handed,
                                        x.get("choices", ()), OpaqueValue(INDEX_ARGUMENT, reads))
        args, kwargs = tree_unflatten(leaves, spec)

        def layer(*layer_args, **layer_kwargs):
            return torch.func.functional_call(template_ref(), layer_tensors, layer_args,
                                              layer_kwargs, strict=True)

        given = recording.make(index, *with_state) if recording else {}
        calls = [] if hooks_replayed else None
        substitution = substituting(numbers, x.get("numbers", ()))
        # Watched only while the step runs: a call whose trace `scan` holds
        # runs no layer code, and swaps no class.
        try:
            with reads_watched(template_ref(), per_layer_paths), \
                    substitution or contextlib.nullcontext(), reads_recorded_in(
                    reads, opaque=recording is not None), (
                    hooks_held(template_ref(), calls) if hooks_replayed
                    else contextlib.nullcontext()), holding(filled) as written:
                if drop_in:
                    hidden = _next_hidden(layer, hidden, args, kwargs, drop_in)
                    output = hidden
                else:
                    output = layer(hidden, *args, **{**kwargs, **given})
                    hidden = hidden_of(output)
        except Exception as error:
            # After a per-layer read the trace went on with the template's
            # value, which another layer's code need not accept: the read is
            # why the trace failed, and the layers run one by one (where the
            # error, if it is the layer's own, is raised as it is).
            refusal = read_refusal(reads, per_layer_paths)
            if refusal is None:
                raise
            raise Unscannable(refusal) from error
        refusal = read_refusal(reads, per_layer_paths) or unmatched(substitution)
        if refusal is not None:
            raise Unscannable(refusal)
        if written:
            path, keys = written[0]
            raise Unscannable(f"the layer writes entries {keys} of argument {path}, a mapping "
                              f"every layer gets, and a scan's layers all see it as it was "
                              f"before the scan")
        _check_recorded_calls(calls)
        if recording is not None and recording.found is not None:
            found_when_traced["found"] = recording.found(given)
        output_leaves = tree_flatten(output)[0]
        handed = {number: output_leaves[number] for number in handed}
        return ((hidden, (tensor_arguments, shared), handed, *with_state),
                (recording.recorded(given) if recording else None, calls,
                 tuple(output_leaves[leaf] for leaf in kept)))

    # Owned by the step, as long as its template lives (`_STEPS`).
    found_when_traced: dict = {}
    run_one_layer.found_when_traced = found_when_traced
    return run_one_layer


def _check_recorded_calls(calls: list | None) -> None:
    """Raises Unscannable unless what the hooked modules got and returned is
    tensors (and None), which the scan can stack along the layers."""
    for path, leaf in tree_flatten_with_path(calls or [])[0]:
        if not isinstance(leaf, (torch.Tensor, type(None))):
            raise Unscannable(f"a hooked module's call holds a {type(leaf).__name__} at "
                              f"{keystr(path)}, and its hooks run after the scan on what the "
                              f"scan stacks, tensors only")
