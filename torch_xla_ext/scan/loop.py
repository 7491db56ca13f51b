"""Loop building: one step lowered to an HLO computation (`lower_body`), and
an XLA While loop over its steps (`Loop`)."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import numbers
import threading
import weakref
from typing import Any, Sequence

import torch
import torch_xla
import torch_xla.core.xla_builder as xb
import torch_xla.core.xla_model as xm
from torch.utils._python_dispatch import _get_current_dispatch_mode

from torch_xla_ext import _C
from torch_xla_ext.scan.avals import Aval
from torch_xla_ext.scan.signature import Slot, SlotKind, split_list

_XLAC = torch_xla._XLAC


@dataclasses.dataclass
class Body:
    """One step, lowered: an HLO computation plus where its parameters come from."""
    computation: Any
    inputs: list          # per HLO parameter: Slot
    constants: list       # tensors baked in at trace time (invariant slots after the given ones)
    output_count: int
    parameters: list      # per HLO parameter: ("placeholder", id) or ("device_data", handle)


def lower_body(name: str, outputs: Sequence[torch.Tensor], stand_ins: dict,
               invariant_count: int) -> Body:
    """Lowers `outputs` to one HLO computation and plans its parameters.

    The values of `stand_ins` are (tensor, Slot) pairs: the stand-ins for the
    carry, the slices and the invariants (its keys are the caller's). Data the
    trace made itself (constants) becomes further invariant slots, and the RNG
    seed a per-step seed slot.

    Every parameter is planned through the C++ `ParameterTable`: a placeholder
    by its process-unique id, device data by its handle. torch_xla's lowering
    itself finds a placeholder's parameter by the address of its data; that is
    safe within this call, because the stand-ins (held by `stand_ins`) and all
    data the outputs read (held by their graphs) stay alive until it returns,
    so no two of them can share an address. Were torch_xla ever to bind two
    of them to one parameter, the plan would see it and raise."""
    outputs = [_with_declared_dtype(t) for t in outputs]
    context = _XLAC.lowering.LoweringContext(name)
    context.build(outputs)
    computation = xb.computation_from_module_proto(name, context.hlo())
    by_parameter = context.device_parameter_id_tensor_mapping()
    stand_in_at = {}
    for tensor, slot in stand_ins.values():
        parameter = context.tensor_parameter_id(tensor)
        if parameter == -1:
            continue  # the step does not read it
        if parameter in stand_in_at:
            raise RuntimeError(
                f"scan: lowering {name!r} bound two stand-ins to HLO parameter {parameter}: "
                f"{_parameter_key(stand_in_at[parameter][0])} and {_parameter_key(tensor)}")
        stand_in_at[parameter] = (tensor, slot)
    seed_parameter = _seed_parameter(context, outputs)
    table = _C.ParameterTable()
    inputs, constants = [], []
    for parameter in range(len(by_parameter)):
        tensor, slot = stand_in_at.get(parameter, (by_parameter[parameter], None))
        if slot is None:
            if _XLAC._is_placecholder(tensor):
                raise ValueError(
                    f"scan: the step {name!r} reads a {Aval.of(tensor)} placeholder that is not "
                    f"an input of fn and that scan could not lift as a capture (it was made "
                    f"outside torch_xla_ext.placeholder(), and is of a tensor class scan does "
                    f"not capture); pass it in init or xs, or make it with "
                    f"torch_xla_ext.placeholder()")
            if parameter == seed_parameter:
                slot = Slot(SlotKind.SEED, 0)
            else:
                slot = Slot(SlotKind.INVARIANT, invariant_count + len(constants))
                constants.append(tensor)
        kind, value = _parameter_key(tensor)
        index = (table.use_placeholder(value) if kind == "placeholder"
                 else table.use_device_data(value))
        if index != parameter:
            raise RuntimeError(
                f"scan: lowering {name!r} gave HLO parameters {index} and {parameter} the same "
                f"data ({kind} {value})")
        inputs.append(slot)
    return Body(computation, inputs, constants, len(outputs), table.parameters)


def _parameter_key(tensor: torch.Tensor) -> tuple[str, int]:
    """What a parameter is planned by: a placeholder's process-unique id (kept
    by the tensor made from it), else the device data's handle."""
    data = getattr(tensor, "_placeholder_data", None)
    if data is not None:
        return "placeholder", data.id
    return "device_data", _XLAC._get_tensors_handle([tensor])[0]


def _seed_parameter(context, outputs) -> int | None:
    """The parameter holding the RNG seed the traced random ops start from."""
    ids, data = _XLAC._get_tensors_xla_device_data_node(list(outputs))
    if not any(_may_be_seed(d) for d in data):
        return None
    seed_id = _current_seed_id(outputs[0].device)
    if seed_id not in ids:
        return None
    return context.tensor_parameter_id(data[ids.index(seed_id)])


def reads_random_seed(tensor: torch.Tensor) -> bool:
    """Whether `tensor` comes from a random op of the current trace (a dropout
    mask): computed again, it would be drawn again, and differ."""
    ids, data = _XLAC._get_tensors_xla_device_data_node([tensor])
    return any(_may_be_seed(d) for d in data) and _current_seed_id(tensor.device) in ids


def _may_be_seed(data: torch.Tensor) -> bool:
    return data.dtype == torch.int64 and data.dim() == 0


@contextlib.contextmanager
def xla_rng_kept(tensors: Sequence[torch.Tensor]):
    """Puts back the XLA RNG state of the tensors' devices after the block.

    Tracing and lowering draw from it (the traced random ops, the seed probes
    above), but a scan's loop draws its seeds from torch's generator: without
    this, the caller's later XLA random numbers (sampling after a scanned
    forward) would differ from those of the for loop. Only those stages need
    it, so a call that reuses its trace and loops does not pay for it."""
    devices = {t.device for t in tensors if t.device.type == "xla"}
    states = {device: xm.get_rng_state(device) for device in devices}
    try:
        yield
    finally:
        for device, state in states.items():
            # Setting the state starts a new root seed; only when it moved.
            if xm.get_rng_state(device) != state:
                xm.set_rng_state(state, device)


def _current_seed_id(device) -> int:
    # Until the next sync, every random op derives its seed from one s64[] device
    # data; a probe random op shows which (torch_xla's seed-info id is not always it).
    ids, data = _XLAC._get_tensors_xla_device_data_node([torch.rand((), device=device)])
    return next(i for i, d in zip(ids, data) if _may_be_seed(d))


def _with_declared_dtype(tensor: torch.Tensor) -> torch.Tensor:
    """torch_xla keeps some bool tensors (dropout masks) as f32 in XLA; a
    round trip through uint8 makes the lowered type bool, as loops expect."""
    if tensor.dtype == torch.bool and _XLAC._xla_op_tensor_shape(tensor, "")["type"] != "pred":
        return tensor.to(torch.uint8).to(torch.bool)
    return tensor


def check_unroll(unroll, caller: str):
    """`unroll` as given to `caller` ("scan", "LayerStack", ...), checked: a
    whole number of steps, 1 or more, per iteration of the loop; True for all
    steps in one iteration, False for 1 (as `jax.lax.scan`)."""
    if isinstance(unroll, bool):
        return unroll if unroll else 1
    if not isinstance(unroll, numbers.Integral):
        raise TypeError(f"{caller}: unroll must be an int (steps per loop iteration) or True "
                        f"(all steps unrolled), got {type(unroll).__name__} {unroll!r}")
    if unroll < 1:
        raise ValueError(f"{caller}: unroll must be 1 or more steps per loop iteration, got "
                         f"{unroll!r}; pass 1 for one step per iteration")
    return int(unroll)


def steps_per_iteration(unroll, length: int) -> int:
    """How many steps one loop iteration runs, for a checked `unroll` over
    `length` steps: more than `length` would only be the same program."""
    return length if unroll is True else min(unroll, length)


class Loop:
    """An XLA While loop over the steps of a `Body`, built once per scan length,
    direction and unroll, and called with the current tensors (`_run_loop`;
    inside a trace, the `torch_xla_ext::scan_loop` op).

    Loop state: (step, carries, sliced inputs, stacked outputs, invariants,
    seeds). Body outputs either replace a carry, are written into slice `i` of a
    stacked output, or are added to a carry (gradient accumulators). With
    `unroll` k, each iteration calls the step k times."""

    def __init__(self, name: str, body: Body, outputs: Sequence[Slot], carry_avals,
                 sliced_avals, stacked_avals, invariant_avals):
        self.name, self.body, self.outputs = name, body, list(outputs)
        self.carry_avals, self.sliced_avals = list(carry_avals), list(sliced_avals)
        self.stacked_avals, self.invariant_avals = list(stacked_avals), list(invariant_avals)
        self.uses_seed = any(slot.kind is SlotKind.SEED for slot in body.inputs)
        self._computations: dict = {}
        self._lock = threading.Lock()
        self.number = next(_LOOP_NUMBERS)
        _LOOPS[self.number] = self

    def __call__(self, carries, sliced, invariants, reverse: bool, unroll):
        length = sliced[0].shape[0]
        # torch_xla can hold a bool tensor's value as s32 (the bitwise `and` of a
        # bool and an int tensor), which the loop's pred parameter refuses: a
        # round trip through uint8 makes it pred whatever it was.
        operands = [operand.to(torch.uint8).to(torch.bool) if operand.dtype == torch.bool
                    else operand for operand in (*carries, *sliced, *invariants)]
        if self.uses_seed:
            # Drawn from torch's generator, so torch.manual_seed makes runs repeatable.
            seeds = torch.randint(0, 2**62, (length,), dtype=torch.int64)
            operands.append(seeds.to(sliced[0].device))
        # The op is for traces (an outer scan's, AOTAutograd's); eagerly the
        # computation runs directly, which saves the dispatcher's 20 us a call.
        traced = (torch._C._is_torch_function_mode_enabled()
                  or _get_current_dispatch_mode() is not None)
        results = (_scan_loop if traced else _run_loop)(
            self.number, length, reverse, steps_per_iteration(unroll, length), operands)
        return results[:len(self.carry_avals)], results[len(self.carry_avals):]

    def output_avals(self, length: int) -> list:
        """(shape, dtype) of each result of a call over `length` steps."""
        return ([(a.shape, a.dtype) for a in self.carry_avals]
                + [((length, *a.shape), a.dtype) for a in self.stacked_avals])

    def computation(self, length: int, reverse: bool, unroll):
        """The loop's XLA computation for `length` steps (built once for each
        direction and number of steps per iteration)."""
        key = (length, reverse, steps_per_iteration(unroll, length))
        with self._lock:
            computation = self._computations.get(key)
            if computation is None:
                computation = self._build(*key)
                self._computations[key] = computation
        return computation

    def _build(self, length: int, reverse: bool, unroll: int):
        body, outputs = self.body, self.outputs
        builder = xb.create_builder(self.name)
        shapes = ([_xla_shape(a.shape, a.dtype) for a in self.carry_avals]
                  + [_xla_shape((length, *a.shape), a.dtype) for a in self.sliced_avals]
                  + [_xla_shape(a.shape, a.dtype) for a in self.invariant_avals])
        if self.uses_seed:
            shapes.append(_xla_shape((length,), torch.int64))
        # The operands come in reversed. torch_xla numbers the graph's inputs as
        # its walk of the graph reaches them, which takes a node's operands last
        # first; XLA gives each donated input buffer (a tensor the step writes
        # in place) to the next output of its size, inputs and outputs in order.
        # Reversed, a loop's inputs are numbered in its operands' order, so a
        # state written in place (a stacked key/value cache) gets its own
        # buffer back rather than its neighbour's, which would cost two copies.
        params = [xb.mkparam(builder, len(shapes) - 1 - i, shape)
                  for i, shape in enumerate(shapes)]
        n_carry, n_sliced = len(self.carry_avals), len(self.sliced_avals)
        carries, sliced, invariants = split_list(params, [n_carry, n_sliced])
        stacked = _stacked_buffers(builder, length, self.stacked_avals)
        n_stacked = len(stacked)
        # The iterations run `unroll` steps each; the `length % unroll` steps
        # left over run after the loop, unrolled: fewer than `unroll` steps, so
        # no second loop, and the loop's steps are numbered as without unroll.
        looped = length - length % unroll

        def run_step(position, carries, sliced, stacked, invariants):
            # `position`: the step's number in running order (an S64 scalar).
            index = (xb.Op.scalar(position.builder(), length - 1, dtype=xb.Type.S64) - position
                     if reverse else position)
            read = {SlotKind.CARRY: carries.__getitem__,
                    SlotKind.SLICED: lambda i: _slice(sliced[i], index),
                    SlotKind.INVARIANT: invariants.__getitem__,
                    SlotKind.SEED: lambda _: _slice(invariants[-1], index)}
            arguments = [read[slot.kind](slot.index) for slot in body.inputs]
            result = xb.Op.call(body.computation, arguments)
            carries, stacked = list(carries), list(stacked)
            for output, slot in enumerate(outputs):
                value = result.get_tuple_element(output)
                if slot.kind is SlotKind.CARRY:
                    carries[slot.index] = value
                elif slot.kind is SlotKind.ACCUMULATE:
                    carries[slot.index] = carries[slot.index] + value
                else:
                    stacked[slot.index] = _update_slice(stacked[slot.index], value, index)
            return carries, stacked

        def unpack(state):
            # (step, carries, sliced, stacked, invariants)
            (step,), *groups = split_list(state, [1, n_carry, n_sliced, n_stacked])
            return step, *groups

        def condition(step, *rest):
            return step < xb.Op.scalar(step.builder(), looped, dtype=xb.Type.S64)

        def iteration(*state):
            step, carries, sliced, stacked, invariants = unpack(state)
            for offset in range(unroll):
                position = step + xb.Op.scalar(step.builder(), offset, dtype=xb.Type.S64)
                carries, stacked = run_step(position, carries, sliced, stacked, invariants)
            advance = xb.Op.scalar(step.builder(), unroll, dtype=xb.Type.S64)
            return xb.Op.tuple((step + advance, *carries, *sliced, *stacked, *invariants))

        if looped:
            step = xb.Op.scalar(builder, 0, dtype=xb.Type.S64)
            loop = xb.Op.mkwhile((step, *carries, *sliced, *stacked, *invariants), condition,
                                 iteration)
            _, carries, sliced, stacked, invariants = unpack(
                loop.get_tuple_element(i)
                for i in range(1 + n_carry + n_sliced + n_stacked + len(invariants)))
        for position in range(looped, length):
            carries, stacked = run_step(xb.Op.scalar(builder, position, dtype=xb.Type.S64),
                                        carries, sliced, stacked, invariants)
        return xb.Op.tuple(list(carries) + list(stacked)).build(self.name)


# The live loops by number (never reused), for the loop op, which an FX graph's
# node calls with the number: the loop's owner (a trace in the cache) keeps it.
_LOOP_NUMBERS = itertools.count()
_LOOPS: "weakref.WeakValueDictionary[int, Loop]" = weakref.WeakValueDictionary()


def _run_loop(loop: int, length: int, reverse: bool, unroll: int,
              operands: list[torch.Tensor]) -> list[torch.Tensor]:
    """One call of a `Loop` over `length` steps."""
    this = _LOOPS[loop]
    # Reversed: see `Loop._build`.
    return list(_XLAC._xla_user_computation(f"xla::{this.name}", operands[::-1],
                                            this.computation(length, reverse, unroll)))


# The call as an op of its own, which an outer scan's trace records as one node,
# AOTAutograd traces by its fake, and lowering makes a While loop in the outer
# loop's body.
_scan_loop = torch.library.custom_op("torch_xla_ext::scan_loop", _run_loop, mutates_args=())


@_scan_loop.register_fake
def _(loop, length, reverse, unroll, operands):
    device = operands[0].device
    return [torch.empty(shape, dtype=dtype, device=device)
            for shape, dtype in _LOOPS[loop].output_avals(length)]


def _stacked_buffers(builder, length: int, stacked_avals) -> list:
    """The initial stacked outputs, `[length, ...]` each. Every slice is
    written before the loop ends, so what fills them does not matter, but
    buffers of one shape and dtype get different fills: XLA merges identical
    broadcasts into one buffer, then copies it whole for each output. (Fills
    cycle: two values for bool, 64 for other dtypes.)"""
    fills: dict = {}
    buffers = []
    for aval in stacked_avals:
        fill = fills[aval.shape, aval.dtype] = fills.get((aval.shape, aval.dtype), -1) + 1
        value = bool(fill % 2) if aval.dtype == torch.bool else fill % 64
        buffers.append(xb.Op.scalar(builder, value, dtype=_xla_type(aval.dtype))
                       .broadcast((length, *aval.shape)))
    return buffers


def hlo_text(computation) -> str:
    """The HLO text of an XLA computation (of a loop, with the step it calls)."""
    return xb.get_computation_hlo(computation)


def _xla_type(dtype: torch.dtype):
    return xb.Op.from_torch_type(dtype)


def _xla_shape(shape, dtype):
    return xb.mkshape(_xla_type(dtype), tuple(shape))


def _slice(stacked: xb.Op, index: xb.Op) -> xb.Op:
    sizes = list(stacked.shape().sizes)
    starts = [index] + [index.zeros_like() for _ in sizes[1:]]
    return stacked.dynamic_slice(starts, [1, *sizes[1:]]).reshape(sizes[1:])


def _update_slice(stacked: xb.Op, value: xb.Op, index: xb.Op) -> xb.Op:
    sizes = list(stacked.shape().sizes)
    starts = [index] + [index.zeros_like() for _ in sizes[1:]]
    return stacked.dynamic_update_slice(value.reshape([1, *sizes[1:]]), starts)


