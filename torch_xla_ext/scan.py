"""`scan`: apply a function over the leading dim of its inputs as one XLA While loop.

Contract, as `jax.lax.scan`::

    scan :: (c -> a -> (c, b)) -> c -> [a] -> (c, [b])

    def scan(fn, init, xs):
        carry, ys = init, []
        for x in xs:
            carry, y = fn(carry, x)
            ys.append(y)
        return carry, stack(ys)

`init`, `xs` and what `fn` returns are PyTrees of XLA tensors (`ys` may hold
`None` leaves). `fn` is traced once with placeholders, never with data, and its
HLO is cached; calls with the same avals reuse it without running `fn` again.

How one trace becomes a loop (`_trace`, then small passes, then `_Loop`):

1. `fn` runs on placeholders under `_LiftCaptures`, which swaps every XLA tensor
   `fn` reads without receiving it (closures, module parameters, buffers) for a
   placeholder of its own. Those captures become loop-invariant inputs, bound
   to their current values at every call.
2. Passes over the traced outputs: read-only carries leave the loop (their
   output is `init` itself), and `xs` slices returned unchanged as `ys` are not
   copied (that `ys` leaf is the `xs` leaf).
3. With gradients, AOTAutograd splits `fn` into a forward and a backward graph,
   `partition_fn` deciding what is saved; both run as While loops (the backward
   in reverse), each lowered once from placeholders.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch_xla
import torch_xla.core.xla_builder as xb
from functorch.compile import aot_function, default_partition, make_boxed_func
import torch_xla.runtime
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import (
    TreeSpec, keystr, tree_flatten, tree_flatten_with_path, tree_map_only, tree_unflatten)

from torch_xla_ext import _C
from torch_xla_ext.placeholders import (
    PlaceholderTensor, mark_derived, placeholder, placeholder_sources, tracing)

__all__ = ["scan", "cache_info", "cache_clear", "default_partition"]

_XLAC = torch_xla._XLAC


# ---------------------------------------------------------------------------
# Public API

def scan(fn: Callable, init, xs, partition_fn: Callable = default_partition,
         is_fn_pure: bool | None = None, *, reverse: bool = False):
    """Loops `fn(carry, x) -> (carry, y)` over the leading dim of `xs`.

    Returns `(carry, ys)` where each `ys` leaf stacks the per-step `y` leaves on a
    new dim 0; `reverse=True` runs from the last slice to the first (`ys` stays in
    `xs` order). Gradients flow to `init`, `xs` and every tensor `fn` reads from
    its closure or its module; `partition_fn` (an AOTAutograd partitioner such as
    `functorch.compile.min_cut_rematerialization_partition`) chooses what the
    forward loop saves for the backward loop.

    `fn` is assumed pure: traced once per set of input avals (shape, dtype,
    requires_grad, structure) and captured tensor avals, then replayed from the
    cache without running its Python body. Pass `is_fn_pure=False` for an `fn`
    whose traced program can change for the same avals (it reads a global flag,
    say): it is then traced at every call. Tensors `fn` creates are baked into
    the trace; tensors it captures are read afresh at every call.
    """
    if not callable(fn):
        raise TypeError(f"scan: fn must be callable, got {type(fn).__name__} {fn!r}")
    if is_fn_pure not in (None, True, False):
        raise TypeError(f"scan: is_fn_pure must be None, True or False, got {is_fn_pure!r}")
    carry_leaves, carry_tree = _flatten_inputs(init, "init")
    xs_leaves, xs_tree = _flatten_inputs(xs, "xs")
    length = _scan_length(xs_leaves, xs_tree)
    key = _CacheKey(
        fn, partition_fn, carry_tree, xs_tree, _avals(carry_leaves),
        tuple(_Aval(tuple(x.shape[1:]), x.dtype, x.requires_grad) for x in xs_leaves))
    traced = _CACHE.lookup(key) if is_fn_pure is not False else None
    if traced is None:
        traced = _trace(key)
        if is_fn_pure is not False:
            _CACHE.store(key, traced)
    captures = traced.current_captures()
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (*carry_leaves, *xs_leaves, *captures))
    if length == 0:
        return init, traced.y_tree.unflatten(
            [_empty_stack(a, carry_leaves + xs_leaves) for a in traced.y_avals])
    carry_out, ys = traced.run(carry_leaves, xs_leaves, captures, reverse, needs_grad)
    # Scanning placeholders stages out HLO; its results must then guard reads like them.
    mark_derived((carry_out, ys), placeholder_sources((carry_leaves, xs_leaves, captures)))
    return carry_tree.unflatten(carry_out), traced.y_tree.unflatten(ys)


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    size: int
    maxsize: int


def cache_info() -> CacheInfo:
    """Hits, misses and size of the cache of traced scan bodies."""
    return _CACHE.info()


def cache_clear() -> None:
    """Empties the cache of traced scan bodies and resets its statistics."""
    _CACHE.clear()


# ---------------------------------------------------------------------------
# Avals, input checks, the carry type check

class _Aval(NamedTuple):
    shape: tuple
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> "_Aval":
        return _Aval(tuple(t.shape), t.dtype, t.requires_grad)

    def __str__(self):
        return f"{str(self.dtype).removeprefix('torch.')}[{','.join(map(str, self.shape))}]"


def _avals(leaves) -> tuple:
    return tuple(_Aval.of(t) for t in leaves)


class _Structure(NamedTuple):
    """A pytree structure whose `None` leaves are kept out of the flat list."""
    spec: TreeSpec
    is_none: tuple

    def unflatten(self, leaves) -> Any:
        leaves = iter(leaves)
        return tree_unflatten([None if none else next(leaves) for none in self.is_none], self.spec)

    def leaf_path(self, name: str, index: int) -> str:
        """`name` and the key path of kept leaf `index`, like "init['h'][0]"; for
        messages only, so it is computed on demand."""
        with_paths = tree_flatten_with_path(tree_unflatten(list(self.is_none), self.spec))[0]
        kept = [path for path, none in with_paths if not none]
        return f"{name}{keystr(kept[index])}"


def _flatten(tree) -> tuple[list, _Structure]:
    """The leaves other than None, and the structure."""
    leaves, spec = tree_flatten(tree)
    return [leaf for leaf in leaves if leaf is not None], _Structure(
        spec, tuple(leaf is None for leaf in leaves))


def _flatten_inputs(tree, name: str) -> tuple[list, _Structure]:
    leaves, structure = _flatten(tree)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"scan: {structure.leaf_path(name, i)} must be a tensor, got "
                            f"{type(leaf).__name__} {leaf!r}; pass non-tensor settings through "
                            f"fn's closure instead")
        if leaf.device.type != "xla":
            raise ValueError(f"scan: {structure.leaf_path(name, i)} is on {leaf.device}, not an "
                             f"XLA device; move it with .to(torch_xla.device())")
    return leaves, structure


def _scan_length(xs_leaves, xs_structure: _Structure) -> int:
    if not xs_leaves:
        raise ValueError("scan: xs has no tensor leaves, so the number of steps is unknown")
    for i, leaf in enumerate(xs_leaves):
        if leaf.dim() == 0:
            raise ValueError(f"scan: {xs_structure.leaf_path('xs', i)} is a 0-d tensor; xs leaves "
                             f"need a leading dim to scan over")
    length = xs_leaves[0].shape[0]
    for i, leaf in enumerate(xs_leaves):
        if leaf.shape[0] != length:
            raise ValueError(
                f"scan: xs leaves must share their leading size: "
                f"{xs_structure.leaf_path('xs', 0)} has {length} but "
                f"{xs_structure.leaf_path('xs', i)} has {leaf.shape[0]} (shape {tuple(leaf.shape)})")
    return length


def _check_carry_types(init_structure: _Structure, init_avals, out_carry) -> list:
    """The carry `fn` returns must have the structure, shapes and dtypes of
    `init`. Returns its leaves."""
    out_leaves, out_structure = _flatten(out_carry)
    if out_structure != init_structure:
        raise TypeError(f"scan: fn must return a carry with the structure of init; init is "
                        f"{init_structure.spec} but fn returned {out_structure.spec}")
    for i, (aval, leaf) in enumerate(zip(init_avals, out_leaves)):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"scan: fn returned {type(leaf).__name__} for carry leaf "
                            f"{init_structure.leaf_path('carry', i)}, which init has as a "
                            f"tensor {aval}")
        if tuple(leaf.shape) != aval.shape or leaf.dtype != aval.dtype:
            raise TypeError(f"scan: fn changed the type of carry leaf "
                            f"{init_structure.leaf_path('carry', i)}: init has {aval} but fn "
                            f"returned {_Aval.of(leaf)}; the carry must keep its shape and dtype")
    return out_leaves


def _empty_stack(aval: _Aval, like: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.empty((0, *aval.shape), dtype=aval.dtype, device=like[0].device)


# ---------------------------------------------------------------------------
# The cache

class _CacheKey(NamedTuple):
    fn: Any
    partition_fn: Any
    carry_tree: _Structure
    xs_tree: _Structure
    carry_avals: tuple
    x_avals: tuple


class _TraceCache:
    """A thread-safe LRU map from `_CacheKey` to `_Traced`."""

    def __init__(self, maxsize: int = 256):
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._maxsize = maxsize
        self._hits = self._misses = 0

    def lookup(self, key: _CacheKey):
        with self._lock:
            traced = self._entries.get(key)
            if traced is not None and traced.captures_still_match():
                self._entries.move_to_end(key)
                self._hits += 1
                return traced
            self._misses += 1
            return None

    def store(self, key: _CacheKey, traced) -> None:
        with self._lock:
            self._entries[key] = traced
            self._entries.move_to_end(key)
            while len(self._entries) > self._maxsize:
                self._entries.popitem(last=False)

    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._entries), self._maxsize)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._hits = self._misses = 0


_CACHE = _TraceCache()


# ---------------------------------------------------------------------------
# Tracing

_CAPTURABLE = (torch.nn.Parameter, PlaceholderTensor)


def _wraps_fake(tensor: torch.Tensor) -> bool:
    # XLA tensors are functional wrappers too; AOTAutograd's wrap fake tensors.
    return (torch._is_functional_tensor(tensor)
            and isinstance(torch._from_functional_tensor(tensor), FakeTensor))


class _LiftCaptures(TorchFunctionMode):
    """Swaps every XLA tensor that `fn` reads without having received or made it
    for a stand-in, so that the trace reads no data and the capture becomes an
    explicit input. `stand_ins` maps id(captured tensor) to its stand-in; new
    captures get a fresh placeholder unless the map is frozen."""

    def __init__(self, arguments: Sequence[torch.Tensor], stand_ins: dict | None = None):
        super().__init__()
        self._known = {id(t): t for t in arguments}
        self.stand_ins = {} if stand_ins is None else stand_ins
        self._frozen = stand_ins is not None
        self.captured: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = tree_map_only(torch.Tensor, self._lift, (args, kwargs or {}))
        result = func(*args, **kwargs)
        for leaf in tree_flatten(result)[0]:
            if isinstance(leaf, torch.Tensor):
                self._known[id(leaf)] = leaf
        return result

    def _lift(self, tensor: torch.Tensor) -> torch.Tensor:
        if (id(tensor) in self._known or tensor.device.type != "xla"
                or not isinstance(tensor, _CAPTURABLE) and type(tensor) is not torch.Tensor
                or _wraps_fake(tensor)):
            return tensor  # made by fn, not on XLA, or one of AOTAutograd's or SPMD's wrappers
        stand_in = self.stand_ins.get(id(tensor))
        if stand_in is None:
            if self._frozen:
                raise RuntimeError(
                    f"scan: fn read a {_Aval.of(tensor)} tensor on its second trace that it did "
                    f"not read on its first; fn must trace the same way each time (or pass "
                    f"is_fn_pure=False)")
            stand_in = placeholder(tensor.shape, tensor.dtype, requires_grad=tensor.requires_grad)
            self.stand_ins[id(tensor)] = stand_in
            self.captured.append(tensor)
        return stand_in


def _stand_in(aval: _Aval, requires_grad: bool | None = None) -> torch.Tensor:
    grad = aval.requires_grad if requires_grad is None else requires_grad
    return placeholder(aval.shape, aval.dtype, requires_grad=grad and aval.dtype.is_floating_point)


def _trace(key: _CacheKey) -> "_Traced":
    carry_in = [_stand_in(a) for a in key.carry_avals]
    x_in = [_stand_in(a) for a in key.x_avals]
    carry_arg, x_arg = _as_fn_arguments(carry_in), _as_fn_arguments(x_in)
    lifter = _LiftCaptures(carry_in + x_in + carry_arg + x_arg)
    with tracing(f"scan's fn {getattr(key.fn, '__qualname__', key.fn)!r}"), lifter:
        carry_out, y_out = _call_body(key.fn, key.carry_tree.unflatten(carry_arg),
                                      key.xs_tree.unflatten(x_arg))
    carry_out = _check_carry_types(key.carry_tree, key.carry_avals, carry_out)
    y_leaves, y_tree = _flatten(y_out)
    for i, leaf in enumerate(y_leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"scan: fn returned {type(leaf).__name__} for {y_tree.leaf_path('y', i)}; "
                            f"y leaves must be tensors or None")
    return _Traced(key, lifter, (carry_in, carry_arg), (x_in, x_arg), carry_out, y_leaves, y_tree)


def _call_body(fn, carry, x):
    result = fn(carry, x)
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise TypeError(f"scan: fn must return a pair (carry, y), got {type(result).__name__}")
    return result


# ---------------------------------------------------------------------------
# SPMD: mark_sharding inside fn

def _as_fn_arguments(stand_ins: Sequence[torch.Tensor]) -> list:
    """What fn receives for its stand-ins. Under SPMD, `stand_in + 0`: torch_xla's
    mark_sharding on device data shards (uploads) the data, which a placeholder
    lacks; on any other value it only annotates. XLA removes the addition."""
    if not torch_xla.runtime.is_spmd():
        return list(stand_ins)
    return [t if t.dtype == torch.bool else t + 0 for t in stand_ins]


_mark_sharding_in_place = _XLAC._xla_mark_sharding
# Shardings that AOTAutograd-traced graphs refer to by index (an OpSharding is
# not a value a graph can hold).
_traced_shardings: list = []


@torch.library.custom_op("torch_xla_ext::sharding_constraint", mutates_args=())
def _sharding_constraint(tensor: torch.Tensor, sharding: int) -> torch.Tensor:
    annotated = tensor.clone()
    _mark_sharding_in_place(annotated, _traced_shardings[sharding])
    return annotated


@_sharding_constraint.register_fake
def _(tensor, sharding):
    return torch.empty_like(tensor)


_sharding_constraint.register_autograd(lambda ctx, grad: (grad, None))


@contextlib.contextmanager
def _functional_mark_sharding():
    """While AOTAutograd traces fn with fake tensors, mark_sharding (an in-place
    annotation that fake tensors cannot take) becomes a functional
    `sharding_constraint` op in the graph, applied when the graph is lowered."""
    if not torch_xla.runtime.is_spmd():
        yield
        return

    def mark(tensor, sharding):
        if not isinstance(tensor, (FakeTensor, FunctionalTensor)):
            return _mark_sharding_in_place(tensor, sharding)
        _traced_shardings.append(sharding)
        tensor.copy_(torch.ops.torch_xla_ext.sharding_constraint(tensor, len(_traced_shardings) - 1))

    _XLAC._xla_mark_sharding = mark
    try:
        yield
    finally:
        _XLAC._xla_mark_sharding = _mark_sharding_in_place


# ---------------------------------------------------------------------------
# Loop plans: which body input comes from where, which output goes where

class _Slot(NamedTuple):
    kind: str   # "carry", "sliced" (xs-like, one slice per step), "invariant", "seed"
    index: int


@dataclasses.dataclass
class _Body:
    """One step, lowered: an HLO computation plus where its parameters come from."""
    computation: Any
    inputs: list          # per HLO parameter: _Slot
    constants: list       # tensors baked in at trace time (invariant slots after the given ones)
    output_count: int


def _lower_body(name: str, outputs: Sequence[torch.Tensor], slots_by_tensor: dict,
                invariant_count: int) -> _Body:
    """Lowers `outputs` to one HLO computation. `slots_by_tensor` maps id() of the
    placeholders standing for carry, slices and invariants to their slot; data
    the trace made itself (constants) become further invariant slots, and the
    RNG seed a per-step seed slot."""
    outputs = [_with_declared_dtype(t) for t in outputs]
    context = _XLAC.lowering.LoweringContext(name)
    context.build(outputs)
    computation = xb.computation_from_module_proto(name, context.hlo())
    by_parameter = context.device_parameter_id_tensor_mapping()
    seed_parameter = _seed_parameter(context, outputs)
    # Constants are planned by the C++ parameter table, keyed on placeholder id
    # or device handle, so the same data read twice binds one invariant slot.
    table = _C.ParameterTable()
    stand_in_of = {}
    for tensor_id, (tensor, slot) in slots_by_tensor.items():
        parameter = context.tensor_parameter_id(tensor)
        if parameter != -1:
            stand_in_of[parameter] = slot
    inputs, constants = [], []
    for parameter in range(len(by_parameter)):
        if parameter in stand_in_of:
            inputs.append(stand_in_of[parameter])
            continue
        tensor = by_parameter[parameter]
        if parameter == seed_parameter:
            inputs.append(_Slot("seed", 0))
            continue
        before = len(table.parameters)
        index = table.use_device_data(_XLAC._get_tensors_handle([tensor])[0])
        if len(table.parameters) > before:
            constants.append(tensor)
        inputs.append(_Slot("invariant", invariant_count + index))
    return _Body(computation, inputs, constants, len(outputs))


def _seed_parameter(context, outputs) -> int | None:
    """The parameter holding the RNG seed the traced random ops start from."""
    ids, data = _XLAC._get_tensors_xla_device_data_node(list(outputs))
    if not any(_may_be_seed(d) for d in data):
        return None
    seed_id = _current_seed_id(outputs[0].device)
    if seed_id not in ids:
        return None
    return context.tensor_parameter_id(data[ids.index(seed_id)])


def _may_be_seed(data: torch.Tensor) -> bool:
    return data.dtype == torch.int64 and data.dim() == 0


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


class _Loop:
    """An XLA While loop over the steps of a `_Body`, built once per scan length
    and direction and called through `_xla_user_computation` with the current
    tensors.

    Loop state: (step, carries, sliced inputs, stacked outputs, invariants,
    seeds). Body outputs either replace a carry, are written into slice `i` of a
    stacked output, or are added to a carry (gradient accumulators)."""

    def __init__(self, name: str, body: _Body, outputs: Sequence[_Slot], carry_avals,
                 sliced_avals, stacked_avals, invariant_avals):
        self.name, self.body, self.outputs = name, body, list(outputs)
        self.carry_avals, self.sliced_avals = list(carry_avals), list(sliced_avals)
        self.stacked_avals, self.invariant_avals = list(stacked_avals), list(invariant_avals)
        self.uses_seed = any(slot.kind == "seed" for slot in body.inputs)
        self._computations: dict = {}
        self._lock = threading.Lock()

    def __call__(self, carries, sliced, invariants, reverse: bool):
        length = sliced[0].shape[0]
        with self._lock:
            computation = self._computations.get((length, reverse))
            if computation is None:
                computation = self._build(length, reverse)
                self._computations[(length, reverse)] = computation
        operands = [*carries, *sliced, *invariants]
        if self.uses_seed:
            # Drawn from torch's generator, so torch.manual_seed makes runs repeatable.
            seeds = torch.randint(0, 2**62, (length,), dtype=torch.int64)
            operands.append(seeds.to(sliced[0].device))
        results = _XLAC._xla_user_computation(f"xla::{self.name}", operands, computation)
        return results[:len(self.carry_avals)], results[len(self.carry_avals):]

    def _build(self, length: int, reverse: bool):
        body, outputs = self.body, self.outputs
        builder = xb.create_builder(self.name)
        shapes = ([_xla_shape(a.shape, a.dtype) for a in self.carry_avals]
                  + [_xla_shape((length, *a.shape), a.dtype) for a in self.sliced_avals]
                  + [_xla_shape(a.shape, a.dtype) for a in self.invariant_avals])
        if self.uses_seed:
            shapes.append(_xla_shape((length,), torch.int64))
        params = [xb.mkparam(builder, i, shape) for i, shape in enumerate(shapes)]
        n_carry, n_sliced = len(self.carry_avals), len(self.sliced_avals)
        carries, sliced = params[:n_carry], params[n_carry:n_carry + n_sliced]
        invariants = params[n_carry + n_sliced:]
        stacked = [xb.Op.scalar(builder, 0, dtype=_xla_type(a.dtype)).broadcast((length, *a.shape))
                   for a in self.stacked_avals]
        step = xb.Op.scalar(builder, 0, dtype=xb.Type.S64)
        n_stacked = len(stacked)

        def unpack(state):
            state = list(state)
            return (state[0], state[1:1 + n_carry], state[1 + n_carry:1 + n_carry + n_sliced],
                    state[1 + n_carry + n_sliced:1 + n_carry + n_sliced + n_stacked],
                    state[1 + n_carry + n_sliced + n_stacked:])

        def condition(step, *rest):
            return step < xb.Op.scalar(step.builder(), length, dtype=xb.Type.S64)

        def step_fn(*state):
            step, carries, sliced, stacked, invariants = unpack(state)
            index = (xb.Op.scalar(step.builder(), length - 1, dtype=xb.Type.S64) - step
                     if reverse else step)
            arguments = []
            for slot in body.inputs:
                if slot.kind == "carry":
                    arguments.append(carries[slot.index])
                elif slot.kind == "sliced":
                    arguments.append(_slice(sliced[slot.index], index))
                elif slot.kind == "invariant":
                    arguments.append(invariants[slot.index])
                else:
                    arguments.append(_slice(invariants[-1], index))
            result = xb.Op.call(body.computation, arguments)
            carries, stacked = list(carries), list(stacked)
            for position, slot in enumerate(outputs):
                value = result.get_tuple_element(position)
                if slot.kind == "carry":
                    carries[slot.index] = value
                elif slot.kind == "accumulate":
                    carries[slot.index] = carries[slot.index] + value
                else:
                    stacked[slot.index] = _update_slice(stacked[slot.index], value, index)
            one = xb.Op.scalar(step.builder(), 1, dtype=xb.Type.S64)
            return xb.Op.tuple((step + one, *carries, *sliced, *stacked, *invariants))

        loop = xb.Op.mkwhile((step, *carries, *sliced, *stacked, *invariants), condition, step_fn)
        results = [loop.get_tuple_element(1 + i) for i in range(n_carry)]
        results += [loop.get_tuple_element(1 + n_carry + n_sliced + i) for i in range(n_stacked)]
        return xb.Op.tuple(results).build(self.name)


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


# ---------------------------------------------------------------------------
# A traced fn and the loops made from it

class _Traced:
    """What one trace of `fn` knows: its captures (held weakly), output structure,
    and, built on first need, the inference loop and the training loops for
    each scan length and direction."""

    def __init__(self, key: _CacheKey, lifter: _LiftCaptures, carry_in_and_arg, x_in_and_arg,
                 carry_out, y_out, y_tree):
        (carry_in, carry_arg), (x_in, x_arg) = carry_in_and_arg, x_in_and_arg
        self.key = key
        self._capture_refs = [weakref.ref(t) for t in lifter.captured]
        self.capture_avals = _avals(lifter.captured)
        self.y_tree = y_tree
        self.y_avals = _avals(y_out)
        # Pass: a carry returned unchanged is read-only and stays out of the loop.
        self.read_only = [out is c for out, c in zip(carry_out, carry_arg)]
        # Pass: an x slice returned as y is not copied; that ys leaf is the xs leaf.
        x_index = {id(x): i for i, x in enumerate(x_arg)}
        self.y_from_x = [x_index.get(id(y)) for y in y_out]
        self.looped_carry = [i for i, ro in enumerate(self.read_only) if not ro]
        self.read_only_carry = [i for i, ro in enumerate(self.read_only) if ro]
        self.stacked_y = [i for i, source in enumerate(self.y_from_x) if source is None]
        capture_in = [lifter.stand_ins[id(t)] for t in lifter.captured]
        # Lowered now, so that the cache keeps no lazy tensors (pending work
        # that reads placeholders) once tracing is over.
        self._inference = _InferencePlan(self, carry_in, x_in, capture_in, carry_out, y_out)
        self._training = None
        self._lock = threading.Lock()

    def captures_still_match(self) -> bool:
        captures = [ref() for ref in self._capture_refs]
        return all(c is not None for c in captures) and _avals(captures) == self.capture_avals

    def current_captures(self) -> list[torch.Tensor]:
        return [ref() for ref in self._capture_refs]

    def run(self, carry, xs, captures, reverse, needs_grad):
        if not needs_grad:
            return self._inference(carry, xs, captures, reverse)
        with self._lock:
            if self._training is None:
                self._training = _TrainingPlan(self)
        return self._training(carry, xs, captures, reverse)

    def assemble(self, carry, xs, looped_carry_out, stacked_ys):
        """The full carry and ys from what a loop computed and what the passes
        kept out of it."""
        carry_out = list(carry)
        for i, value in zip(self.looped_carry, looped_carry_out):
            carry_out[i] = value
        ys = [None] * len(self.y_avals)
        for i, value in zip(self.stacked_y, stacked_ys):
            ys[i] = value
        for i, source in enumerate(self.y_from_x):
            if source is not None:
                ys[i] = xs[source]
        return carry_out, ys


class _InferencePlan:
    """Forward only: the trace itself, lowered once."""

    def __init__(self, traced: _Traced, carry_in, x_in, capture_in, carry_out, y_out):
        self.traced = traced
        slots = {}
        for position, i in enumerate(traced.looped_carry):
            slots[id(carry_in[i])] = (carry_in[i], _Slot("carry", position))
        for i, x in enumerate(x_in):
            slots[id(x)] = (x, _Slot("sliced", i))
        given = [carry_in[i] for i in traced.read_only_carry] + list(capture_in)
        for k, t in enumerate(given):
            slots[id(t)] = (t, _Slot("invariant", k))
        outputs = ([carry_out[i] for i in traced.looped_carry]
                   + [y_out[i] for i in traced.stacked_y])
        body = _lower_body("scan_step", outputs, slots, len(given))
        self.constants = body.constants
        out_slots = ([_Slot("carry", p) for p in range(len(traced.looped_carry))]
                     + [_Slot("stacked", p) for p in range(len(traced.stacked_y))])
        self.loop = _Loop("scan", body, out_slots,
                          [traced.key.carry_avals[i] for i in traced.looped_carry],
                          traced.key.x_avals, [traced.y_avals[i] for i in traced.stacked_y],
                          _avals(given) + _avals(body.constants))

    def __call__(self, carry, xs, captures, reverse):
        traced = self.traced
        invariants = [carry[i] for i in traced.read_only_carry] + list(captures) + self.constants
        carry_out, stacked = self.loop([carry[i] for i in traced.looped_carry], xs, invariants,
                                       reverse)
        return traced.assemble(carry, xs, carry_out, stacked)


class _TrainingPlan:
    """Forward and backward loops from AOTAutograd's partitioned graphs.

    Inputs of one step: looped carries, x slices and invariants (read-only
    carries, then captures). The forward loop also stacks the activations the
    backward graph needs, except those it can get for free: slices of `xs` are
    read from `xs` itself, and values computed from invariants alone or from an
    x slice by layout ops alone (a weight's transpose) are recomputed in the
    backward step instead of stacked.
    """

    def __init__(self, traced: _Traced):
        self.traced = traced
        key = traced.key
        carry_avals = [key.carry_avals[i] for i in traced.looped_carry]
        invariant_avals = ([key.carry_avals[i] for i in traced.read_only_carry]
                           + list(traced.capture_avals))
        any_grad = any(a.requires_grad for a in (*key.carry_avals, *key.x_avals, *invariant_avals))
        # Gradients flow through every floating carry, whichever input asked for them.
        carry_grad = [a.dtype.is_floating_point and any_grad for a in carry_avals]
        self.input_avals = ([a._replace(requires_grad=g) for a, g in zip(carry_avals, carry_grad)]
                            + list(key.x_avals) + invariant_avals)
        self.sizes = (len(carry_avals), len(key.x_avals), len(invariant_avals))
        fw_graph, bw_graph, differentiable = self._partition()
        self._build_loops(fw_graph, bw_graph, differentiable)

    def _step(self, *primals):
        """One step as a flat function of (looped carries, x, invariants) for
        AOTAutograd, returning (looped carry outs, stacked ys)."""
        traced, key = self.traced, self.traced.key
        n_carry, n_x, _ = self.sizes
        carry = list(primals[:n_carry])
        x, invariants = primals[n_carry:n_carry + n_x], primals[n_carry + n_x:]
        full_carry = [None] * len(key.carry_avals)
        for i, value in zip(traced.looped_carry, carry):
            full_carry[i] = value
        for i, value in zip(traced.read_only_carry, invariants):
            full_carry[i] = value
        captures = invariants[len(traced.read_only_carry):]
        stand_ins = {id(c): v for c, v in zip(traced.current_captures(), captures)}
        full_carry, x = _as_fn_arguments(full_carry), _as_fn_arguments(x)
        with _LiftCaptures(list(primals) + full_carry + x, stand_ins):
            carry_out, y_out = _call_body(key.fn, key.carry_tree.unflatten(full_carry),
                                          key.xs_tree.unflatten(x))
        carry_out = _flatten(carry_out)[0]
        y_out = _flatten(y_out)[0]
        outputs = ([carry_out[i] for i in traced.looped_carry]
                   + [y_out[i] for i in traced.stacked_y])
        # AOTAutograd keeps outputs that alias inputs out of its graphs; copies
        # keep them in (XLA removes the copy).
        return tuple(o.clone() if o._is_view() or any(o is p for p in primals) else o
                     for o in outputs)

    def _partition(self):
        graphs = {}

        def keep(name):
            def compiler(graph, _inputs):
                graphs[name] = graph
                return make_boxed_func(graph)
            return compiler

        compiled = aot_function(self._step, fw_compiler=keep("forward"),
                                bw_compiler=keep("backward"), partition_fn=self.traced.key.partition_fn)
        primals = [xb.create_placeholder_tensor(a.shape, a.dtype).requires_grad_(a.requires_grad)
                   for a in self.input_avals]
        with torch.enable_grad(), tracing("scan's fn (differentiated)"), _functional_mark_sharding():
            outputs = compiled(*primals)
            differentiable = [o.requires_grad for o in outputs]
            roots = [o for o in outputs if o.requires_grad]
            if roots:
                torch.autograd.backward(roots, [xb.create_placeholder_tensor(o.shape, o.dtype)
                                                for o in roots])
        if "backward" not in graphs:
            raise ValueError("scan: none of fn's outputs depends on an input that requires grad")
        return graphs["forward"], graphs["backward"], differentiable

    def _build_loops(self, fw_graph, bw_graph, differentiable):
        stand_ins = [_stand_in(a, requires_grad=False) for a in self.input_avals]
        outputs, activations, saved_sources = self._build_forward_loop(fw_graph, stand_ins)
        self._build_backward_loop(bw_graph, differentiable, stand_ins, outputs, activations,
                                  saved_sources)

    def _build_forward_loop(self, fw_graph, stand_ins):
        """Lowers the forward graph; returns its lazy outputs, the activations it
        stacks, and where the backward step gets each saved value."""
        n_carry, n_x, n_inv = self.sizes
        n_out = n_carry + len(self.traced.stacked_y)
        carry_in, x_in = stand_ins[:n_carry], stand_ins[n_carry:n_carry + n_x]
        invariants_in = stand_ins[n_carry + n_x:]
        slots = {}
        for i, t in enumerate(carry_in):
            slots[id(t)] = (t, _Slot("carry", i))
        for i, t in enumerate(x_in):
            slots[id(t)] = (t, _Slot("sliced", i))
        for i, t in enumerate(invariants_in):
            slots[id(t)] = (t, _Slot("invariant", i))
        with torch.no_grad(), tracing("scan's forward step"):
            fw_outputs = fw_graph(*stand_ins)
        outputs, saved = list(fw_outputs[:n_out]), list(fw_outputs[n_out:])

        # Pass: classify what the backward step reads. An x slice is read from
        # xs; a value computed from invariants alone, or from an x slice by
        # layout ops only (a layer weight's transpose), is recomputed in the
        # backward step; anything else is an activation, stacked.
        carry_ids = {_XLAC._xla_get_tensor_id(t) for t in carry_in}
        x_ids = {_XLAC._xla_get_tensor_id(t) for t in x_in}
        x_index = {id(t): i for i, t in enumerate(x_in)}
        saved_nodes = _output_nodes(fw_graph)[n_out:]
        primal_nodes = [n for n in fw_graph.graph.nodes if n.op == "placeholder"]
        free_inputs = set(primal_nodes[n_carry:])  # x slices and invariants
        saved_sources = []
        activations = []
        for value, node in zip(saved, saved_nodes):
            reads = set(_XLAC._get_tensors_xla_device_data_node([value])[0])
            if id(value) in x_index:
                saved_sources.append(("x", x_index[id(value)]))
            elif carry_ids.isdisjoint(reads) and (
                    x_ids.isdisjoint(reads) or _is_layout_of(node, free_inputs)):
                saved_sources.append(("recomputed", value))
            else:
                saved_sources.append(("stacked", len(activations)))
                activations.append(value)

        forward_body = _lower_body("scan_forward_step", outputs + activations, slots, n_inv)
        self.forward_constants = forward_body.constants
        out_slots = ([_Slot("carry", i) for i in range(n_carry)]
                     + [_Slot("stacked", i)
                        for i in range(len(self.traced.stacked_y) + len(activations))])
        self.activation_count = len(activations)
        self.forward_loop = _Loop(
            "scan_forward", forward_body, out_slots, self.input_avals[:n_carry],
            self.input_avals[n_carry:n_carry + n_x],
            _avals(outputs[n_carry:]) + _avals(activations),
            self.input_avals[n_carry + n_x:] + list(_avals(forward_body.constants)))
        return outputs, activations, saved_sources

    def _build_backward_loop(self, bw_graph, differentiable, stand_ins, outputs, activations,
                             saved_sources):
        """Lowers the backward graph. Its loop carries the carry gradients, then
        accumulators for invariant gradients; its sliced inputs are activations,
        y gradients and xs."""
        n_carry, n_x, n_inv = self.sizes
        x_in, invariants_in = stand_ins[n_carry:n_carry + n_x], stand_ins[n_carry + n_x:]
        self.carry_tangents = [i for i in range(n_carry) if differentiable[i]]
        self.y_tangents = [i for i in range(len(self.traced.stacked_y))
                           if differentiable[n_carry + i]]
        self.grad_x = [i for i in range(n_x) if self.input_avals[n_carry + i].requires_grad]
        self.grad_invariants = [i for i in range(n_inv)
                                if self.input_avals[n_carry + n_x + i].requires_grad]
        bw_slots = {}
        activation_in = [_stand_in(a, False) for a in _avals(activations)]
        for i, t in enumerate(activation_in):
            bw_slots[id(t)] = (t, _Slot("sliced", i))
        y_tangent_in = []
        for position, i in enumerate(self.y_tangents):
            t = _stand_in(_avals(outputs)[n_carry + i], False)
            bw_slots[id(t)] = (t, _Slot("sliced", len(activations) + position))
            y_tangent_in.append(t)
        x_offset = len(activations) + len(self.y_tangents)
        for i, t in enumerate(x_in):
            bw_slots[id(t)] = (t, _Slot("sliced", x_offset + i))
        for i, t in enumerate(invariants_in):
            bw_slots[id(t)] = (t, _Slot("invariant", i))
        carry_tangent_in = []
        for position, i in enumerate(self.carry_tangents):
            t = _stand_in(self.input_avals[i], False)
            bw_slots[id(t)] = (t, _Slot("carry", position))
            carry_tangent_in.append(t)
        saved_in = []
        for kind, what in saved_sources:
            saved_in.append(x_in[what] if kind == "x" else what if kind == "recomputed"
                            else activation_in[what])
        tangents = carry_tangent_in + y_tangent_in
        with torch.no_grad(), tracing("scan's backward step"):
            grads = list(bw_graph(*saved_in, *tangents))
        grads = [g if g is not None else torch.zeros(a.shape, dtype=a.dtype, device=x_in[0].device)
                 for g, a in zip(grads, self.input_avals)]
        grad_outputs = ([grads[i] for i in self.carry_tangents]
                        + [grads[n_carry + n_x + i] for i in self.grad_invariants]
                        + [grads[n_carry + i] for i in self.grad_x])
        backward_body = _lower_body("scan_backward_step", grad_outputs, bw_slots, n_inv)
        self.backward_constants = backward_body.constants
        n_tangent_carry = len(self.carry_tangents)
        bw_out_slots = ([_Slot("carry", i) for i in range(n_tangent_carry)]
                        + [_Slot("accumulate", n_tangent_carry + i)
                           for i in range(len(self.grad_invariants))]
                        + [_Slot("stacked", i) for i in range(len(self.grad_x))])
        invariant_avals = self.input_avals[n_carry + n_x:]
        self.backward_loop = _Loop(
            "scan_backward", backward_body, bw_out_slots,
            [self.input_avals[i] for i in self.carry_tangents]
            + [invariant_avals[i] for i in self.grad_invariants],
            list(_avals(activations)) + [_avals(outputs)[n_carry + i] for i in self.y_tangents]
            + list(self.input_avals[n_carry:n_carry + n_x]),
            [self.input_avals[n_carry + i] for i in self.grad_x],
            list(invariant_avals) + list(_avals(backward_body.constants)))

    def __call__(self, carry, xs, captures, reverse):
        traced = self.traced
        inputs = ([carry[i] for i in traced.looped_carry] + list(xs)
                  + [carry[i] for i in traced.read_only_carry] + list(captures))
        results = _ScanFunction.apply(self, reverse, *inputs)
        n_carry = self.sizes[0]
        return traced.assemble(carry, xs, results[:n_carry], results[n_carry:])

    def forward(self, inputs, reverse):
        n_carry, n_x, _ = self.sizes
        carry, xs = inputs[:n_carry], inputs[n_carry:n_carry + n_x]
        invariants = list(inputs[n_carry + n_x:]) + self.forward_constants
        carry_out, stacked = self.forward_loop(carry, xs, invariants, reverse)
        split = len(stacked) - self.activation_count
        return list(carry_out) + list(stacked[:split]), stacked[split:]

    def backward(self, inputs, activations, output_grads, reverse):
        n_carry, n_x, n_inv = self.sizes
        xs, invariants = inputs[n_carry:n_carry + n_x], inputs[n_carry + n_x:]
        carry_grads, y_grads = output_grads[:n_carry], output_grads[n_carry:]
        zeros = [torch.zeros(invariants[i].shape, dtype=invariants[i].dtype,
                             device=invariants[i].device) for i in self.grad_invariants]
        carries = [carry_grads[i] for i in self.carry_tangents] + zeros
        sliced = list(activations) + [y_grads[i] for i in self.y_tangents] + list(xs)
        carry_out, stacked = self.backward_loop(
            carries, sliced, list(invariants) + self.backward_constants, not reverse)
        grads = [None] * len(inputs)
        for position, i in enumerate(self.carry_tangents):
            grads[i] = carry_out[position]
        for position, i in enumerate(self.grad_invariants):
            grads[n_carry + n_x + i] = carry_out[len(self.carry_tangents) + position]
        for position, i in enumerate(self.grad_x):
            grads[n_carry + i] = stacked[position]
        return grads


# Ops that move no data but only reinterpret its layout: recomputing them in the
# backward step costs nothing, stacking their results costs a copy per step.
_LAYOUT_OPS = frozenset(["t", "transpose", "permute", "view", "_unsafe_view", "reshape",
                         "expand", "slice", "select", "unsqueeze", "squeeze", "alias",
                         "detach", "clone"])


def _output_nodes(graph_module) -> list:
    output = next(n for n in reversed(graph_module.graph.nodes) if n.op == "output")
    return list(output.args[0])


def _is_layout_of(node, inputs: set) -> bool:
    """Whether the FX `node` is computed from `inputs` by layout ops alone."""
    if node in inputs:
        return True
    if node.op != "call_function" or getattr(node.target, "_opname", None) not in _LAYOUT_OPS:
        return False
    return all(_is_layout_of(arg, inputs) for arg in node.all_input_nodes)


class _ScanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _TrainingPlan, reverse: bool, *inputs):
        outputs, activations = plan.forward(inputs, reverse)
        ctx.plan, ctx.reverse = plan, reverse
        ctx.save_for_backward(*inputs, *activations)
        ctx.input_count = len(inputs)
        ctx.mark_non_differentiable(*[o for o in outputs if not o.dtype.is_floating_point])
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *output_grads):
        saved = ctx.saved_tensors
        grads = ctx.plan.backward(saved[:ctx.input_count], saved[ctx.input_count:], output_grads,
                                  ctx.reverse)
        return (None, None, *grads)
