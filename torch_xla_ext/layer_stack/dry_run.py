"""What an owner's forward does with its stacked layers, found by running it
once with the layers replaced by recorders: the dry run.

The forward runs on the call's own inputs, so that everything it does
around the loop (embeddings, masks, rotary tables, caches it makes) is what
the real call does; only the layers do not run. Each layer call is
recorded (what the layer gets) and answered with what the layer would give
back: its output's structure, found by running the layer once per kind of
call on fake tensors (no data); values it hands back unchanged are the
very arguments it got, and values it computes are placeholders (tensors
with a shape and no data), so that using one's value raises
`PlaceholderError` instead of computing anything. What a layer writes in a
mapping that every layer gets (`shared_mappings`) is written, as
placeholders, in the forward's mapping, and recorded; each mapping is put
back as the call gave it afterwards. The attributes a layer sets on its own
modules are recorded and put back (`layer_state`).

Meanwhile a torch function mode watches the forward between the layer
calls: which placeholders it uses other than by handing them to a layer
(an op on them, or returning them: the owner keeps per-layer outputs), and
whether it reads a tensor's value while looping (which layers run, or how
often, can then change from call to call: LayerDrop). The random number
generators are put back afterwards, so the real call draws what it would
have drawn. `CallRecord` is what the dry run found; `planner` reads it.
"""
from __future__ import annotations

import dataclasses
import os
import sysconfig
import traceback
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from torch_xla_ext.layer_stack.executors import executor_of_call
from torch_xla_ext.layer_stack.fakes import fake_leaves, fake_mode, fake_weights, faking
from torch_xla_ext.layer_stack.hooks import hooks_held
from torch_xla_ext.layer_stack.kinds import program_of
from torch_xla_ext.layer_stack.layer_state import attributes_restored
from torch_xla_ext.layer_stack.owner_loops import ReadRecorder, driving, iterating
from torch_xla_ext.layer_stack.shared_mappings import is_shared_mapping, written_keys
from torch_xla_ext.object_graph import VALUE_TYPES
from torch_xla_ext.scan.loop import xla_rng_kept

__all__ = ["CallRecord", "RecordedCall", "Source", "record_calls"]

# Functions that read a tensor's value on the host.
_VALUE_READS = frozenset([
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy,
    torch.Tensor.is_nonzero, torch.is_nonzero, torch.equal, torch.Tensor.equal,
    torch.allclose, torch.Tensor.allclose])


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a value a layer gives back comes from: `argument` (the very
    argument leaf `value` of the call), `constant` (`value` itself),
    `computed` (a tensor of shape and dtype `value`), or `object` (another
    object the layer made, of type name `value`)."""
    kind: str
    value: Any


@dataclasses.dataclass
class RecordedCall:
    """One layer call of the dry run: what the layer got and gave back."""
    index: int
    leaves: list  # of (args, kwargs), as the forward passed them
    spec: TreeSpec
    sources: tuple[Source, ...]  # of the output's leaves
    output_spec: TreeSpec
    outputs: list  # the output's leaves, as the recorder gave them
    # What the layer computes (`kinds.program_of`), where its list's layers
    # are of several kinds, else None.
    program: tuple | None = None
    # The Python numbers of its arithmetic, where `program` was traced
    # (`lifted_numbers`): the call plan lifts those that differ between layers.
    numbers: tuple | None = None
    # (argument leaf, key) of each entry the layer set or deleted in a
    # mapping every layer gets (`shared_mappings`).
    writes: tuple = ()
    # The paths of the attributes the layer set on its own modules (`layer_state`).
    attributes: tuple[str, ...] = ()


@dataclasses.dataclass
class CallRecord:
    """What the dry run of one forward found, per stacked list (by name)."""
    calls: dict[str, list[RecordedCall]]
    # ids of computed outputs the forward used other than by handing them on,
    # each with where it first did
    used: dict[int, str]
    outputs: set[int] = dataclasses.field(default_factory=set)  # ids of all computed outputs
    read: str | None = None  # where the forward read a tensor's value while looping
    # What the forward read of each list's loop items (`decoder_layer.attention_type`):
    # by list name, layer index and attribute name, the value it got.
    attributes_read: dict[str, dict[int, dict[str, Any]]] = dataclasses.field(
        default_factory=dict)
    failure: str | None = None  # why the dry run did not complete


def record_calls(owner: nn.Module, stacks: dict[str, nn.Module], args: tuple,
                 kwargs: dict) -> CallRecord:
    """Runs `owner.forward(*args, **kwargs)` with the layers of `stacks` (its
    lists, by name) recorded (see the module docstring)."""
    record = CallRecord({name: [] for name in stacks}, {},
                        attributes_read={name: {} for name in stacks})
    recorders = {name: _Recorder(stack, record.calls[name], record.outputs,
                                 record.attributes_read[name])
                 for name, stack in stacks.items()}
    watch = _Watch(recorders.values(), record)
    tensors = [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)]
    cpu_state = torch.get_rng_state()
    try:
        with xla_rng_kept(tensors + [param for stack in stacks.values()
                                     for param in stack.parameters()][:1]):
            entries = [driving(stack, recorders[name]) for name, stack in stacks.items()]
            for entry in entries:
                entry.__enter__()
            try:
                with watch:
                    result = owner.forward(*args, **kwargs)
            finally:
                for entry in entries:
                    entry.__exit__(None, None, None)
    except Exception as error:  # the dry run is a probe: what stopped it is its finding
        record.failure = _failure(owner, error)
        return record
    finally:
        torch.set_rng_state(cpu_state)
        for recorder in recorders.values():  # the mappings as the call gave them
            for mapping, entries in recorder.originals.values():
                mapping.clear()
                mapping.update(entries)
    for leaf in tree_flatten(result)[0]:
        if id(leaf) in record.outputs:
            record.used.setdefault(id(leaf), f"{type(owner).__qualname__}.forward's result")
    return record


def _failure(owner: nn.Module, error: Exception) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    where = next((f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`"
                  for frame in reversed(frames) if _outside_torch(frame.filename)), "")
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return (f"{type(owner).__qualname__}.forward, run once with its layers recorded on "
            f"stand-ins, raised {type(error).__name__} at {where}: {first_line}")


class _Recorder(ReadRecorder):
    """The dry run's driver of one stacked list's loop."""

    def __init__(self, stack: nn.Module, calls: list, outputs: set, attributes_read: dict):
        self.stack = stack
        self.calls = calls
        self.outputs = outputs  # ids of the computed outputs of every list's calls
        self.attributes_read = attributes_read  # `CallRecord.attributes_read` of the list
        self.inside = False  # a layer's fake run is under way
        self._found: dict[tuple, tuple] = {}  # per kind of call: what `_fake_run` found
        # The shared mappings the layers wrote in, by id: (mapping, its entries before).
        self.originals: dict[int, tuple] = {}

    def call(self, index: int, args: tuple, kwargs: dict):
        leaves, spec = tree_flatten((args, kwargs))
        self.inside = True
        try:
            sources, output_spec, requires_grad, writes, attributes = self._sources(
                index, leaves, spec)
        finally:
            self.inside = False
        outputs = _values(sources, leaves, requires_grad)
        for position, key, written in writes:
            self._write(leaves[position], key, written and tree_unflatten(
                _values(written[0], leaves, written[2]), written[1]))
        program = numbers = None
        if self.stack.kinds_in_segment_of(index) > 1:
            program, numbers = self._program(index, leaves, spec)
        self.calls.append(RecordedCall(index, leaves, spec, sources, output_spec, outputs,
                                       program, numbers, tuple((position, key)
                                                               for position, key, _ in writes),
                                       attributes))
        self.outputs.update(id(each) for each, source in zip(outputs, sources)
                            if source.kind == "computed")
        return tree_unflatten(outputs, output_spec)

    def read(self, index: int, name: str, value) -> None:
        self.attributes_read.setdefault(index, {})[name] = value

    def _write(self, mapping, key, value) -> None:
        """Sets (a None `value`: deletes) `mapping[key]` as the layer did, the
        mapping's own entries kept to be put back after the dry run."""
        self.originals.setdefault(id(mapping), (mapping, dict(mapping.items())))
        if value is None:
            mapping.pop(key, None)
        else:
            mapping[key] = value

    def _sources(self, index: int, leaves: list, spec: TreeSpec) -> tuple:
        key = (self.stack.call_kind(index), spec, tuple(_leaf_key(leaf) for leaf in leaves))
        if key not in self._found:
            self._found[key] = _fake_run(self.stack.built_layer(index), leaves, spec)
        return self._found[key]

    def _program(self, index: int, leaves: list, spec: TreeSpec) -> tuple[tuple, tuple]:
        """`kinds.program_of` the call: (its program, its numbers)."""
        key = ("program", self.stack.call_kind(index), spec,
               tuple(_leaf_key(leaf) for leaf in leaves))
        if key not in self._found:
            self.inside = True
            try:
                layer = self.stack.built_layer(index)
                with attributes_restored(layer):
                    self._found[key] = program_of(layer, self.stack.as_traced(leaves), spec)
            finally:
                self.inside = False
        return self._found[key]


def _leaf_key(leaf) -> tuple:
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.requires_grad)
    if isinstance(leaf, VALUE_TYPES):
        return (type(leaf), leaf)
    if is_shared_mapping(leaf):  # what a layer finds in it can change what it does
        return (type(leaf), id(leaf), tuple(
            (key, tuple(_leaf_key(each) for each in tree_flatten(value)[0]))
            for key, value in leaf.items()))
    return (type(leaf), id(leaf))


def _values(sources: tuple, leaves: list, requires_grad: tuple) -> list:
    """What the recorder gives for leaves of `sources`: the call's own
    leaves, constants, and stand-ins (`Executor.stand_in`) for what the
    layer computed."""
    grads, stand_in = iter(requires_grad), executor_of_call().stand_in
    device = next(leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor))
    return [leaves[source.value] if source.kind == "argument"
            else source.value if source.kind == "constant"
            else stand_in(*source.value, device, requires_grad=next(grads))[0]
            if source.kind == "computed" else None for source in sources]


def _fake_run(layer: nn.Module, leaves: list, spec: TreeSpec) -> tuple:
    """(the sources of the output's leaves, the output's spec, whether each
    computed leaf requires grad, the layer's writes into shared mappings,
    the paths of the attributes it set on its own modules, which are put
    back) of `layer` called on stand-ins of `leaves` (`fakes`), its weights
    fakes too and its forward hooks held. Each write is (argument leaf, key,
    and the value's sources, spec and requires grad, or None where the layer
    deleted the entry)."""
    mode = fake_mode()
    given = fake_leaves(mode, leaves)
    args, kwargs = tree_unflatten(given, spec)
    before = {position: dict(each.items()) for position, each in enumerate(given)
              if is_shared_mapping(each)}
    with faking(mode), hooks_held(layer), attributes_restored(layer) as attributes:
        output = torch.func.functional_call(layer, fake_weights(mode, layer), args, kwargs,
                                            strict=True)
    positions = {id(each): position for position, each in enumerate(given)
                 if not isinstance(each, VALUE_TYPES)}
    output_leaves, output_spec = tree_flatten(output)
    writes = []
    for position, entries in before.items():
        for key in written_keys(entries, given[position]):
            if key not in given[position]:
                writes.append((position, key, None))
                continue
            value = given[position][key]
            value_leaves, value_spec = tree_flatten(value)
            value_sources, value_grads = _sources_of(value_leaves, positions)
            if any(source.kind == "object" for source in value_sources):
                raise TypeError(f"the layer puts a {type(value).__name__} holding objects other "
                                f"than tensors and constants in entry {key!r} of a mapping "
                                f"that every layer gets, which the dry run cannot stand for")
            writes.append((position, key, (value_sources, value_spec, value_grads)))
    sources, requires_grad = _sources_of(output_leaves, positions)
    return sources, output_spec, requires_grad, tuple(writes), tuple(attributes)


def _sources_of(leaves: list, positions: dict) -> tuple[tuple, tuple]:
    """The `Source` of each of a fake run's result `leaves`, and whether each
    computed one requires grad (`positions`: the call's leaves by id)."""
    sources, requires_grad = [], []
    for leaf in leaves:
        if id(leaf) in positions:
            sources.append(Source("argument", positions[id(leaf)]))
        elif isinstance(leaf, VALUE_TYPES):
            sources.append(Source("constant", leaf))
        elif isinstance(leaf, torch.Tensor):
            sources.append(Source("computed", (tuple(leaf.shape), leaf.dtype)))
            requires_grad.append(leaf.requires_grad)
        else:
            sources.append(Source("object", type(leaf).__name__))
    return tuple(sources), tuple(requires_grad)


class _Watch(TorchFunctionMode):
    """Watches the forward between layer calls (see the module docstring)."""

    def __init__(self, recorders, record: CallRecord):
        super().__init__()
        self.recorders = list(recorders)
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Reading a tensor's metadata (`.dtype`, `.shape`: a descriptor's
        # __get__) uses none of its values.
        if not any(recorder.inside for recorder in self.recorders) and not _reads_metadata(func):
            for leaf in tree_flatten((args, kwargs))[0]:
                if id(leaf) in self.record.outputs and id(leaf) not in self.record.used:
                    self.record.used[id(leaf)] = _user_line()
            if func in _VALUE_READS and self.record.read is None and self._looping():
                self.record.read = _user_line()
        return func(*args, **kwargs)

    def _looping(self) -> bool:
        """Whether a list's loop is under way: an iteration over the list (from
        its first item on, so that a read deciding to skip layer 0 counts), or
        some, not all, of its layers called (a loop over a slice)."""
        return any(iterating(recorder.stack) or 0 < len(recorder.calls) < len(recorder.stack)
                   for recorder in self.recorders)


def _reads_metadata(func) -> bool:
    return getattr(func, "__name__", None) == "__get__"


def _outside_torch(filename: str) -> bool:
    """Whether a frame is of the model's code (or the user's): not torch's,
    this package's or the standard library's, which name no model's line."""
    return ("/torch/" not in filename and "/torch_xla_ext/" not in filename
            and not filename.startswith(_STANDARD_LIBRARY))


_STANDARD_LIBRARY = sysconfig.get_paths()["stdlib"] + os.sep


def _user_line() -> str:
    """'file:line: `code`' of the innermost frame outside torch and this package."""
    for frame in reversed(traceback.extract_stack()):
        if _outside_torch(frame.filename):
            return f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`"
    return "an unknown line"
