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

How one call runs, one module a stage:

1. `cache`: the call's key (a fingerprint of fn and the partitioner,
   structures, avals, autocast state) finds a `Traced` from an earlier call, or
2. `tracing`: `fn` runs once on placeholders; every XLA tensor it reads without
   receiving it (closures, module parameters, buffers) is lifted into a
   loop-invariant input, bound to its current value at every call.
   `mutation`: what `fn` wrote in place is carried (captures) or stacked
   (`xs` slices), and written back after the loop. `regions`: torch_xla's
   checkpoint inside `fn` runs as a region the backward step recomputes.
3. `passes`: read-only carries leave the loop (their output is `init` itself),
   `xs` slices returned unchanged as `ys` are not copied, and saved values that
   are cheap to recompute are not stacked.
4. `loop`: the step is lowered once to HLO and run as an XLA While loop
   (`unroll` steps an iteration, the loop's HLO built per unroll);
   `autograd`: with gradients, AOTAutograd splits `fn` into forward and
   backward graphs (`partition_fn`, a policy of `torch_xla_ext.policies`,
   deciding what is saved), both run as While loops (the backward in reverse);
   `cotangents`: the backward that also gives the steps' cotangents of their
   ys, for a caller whose ys are values its steps use (`StepCotangents`).
   `traced` holds a trace and its loops; `lower` returns their HLO unrun.

`nested`: a scan called while another scan traces its fn is traced apart from
it and runs as a loop of its own in the outer step (the loop is one op,
`torch_xla_ext::scan_loop`); where it cannot, `inline` runs it as its for
loop, unrolled into the outer step.
"""
from __future__ import annotations

import dataclasses
import sys
import types
from typing import Callable

import torch
import torch_xla.runtime
from functorch.compile import default_partition

from torch_xla_ext import policies
from torch_xla_ext.placeholders import (
    is_tracing, mark_derived, placeholder_sources, tracing_what)
from torch_xla_ext.scan.avals import (Aval, as_placeholders, avals, empty_stack, flatten_inputs,
                                      keyed_grad, scan_length)
from torch_xla_ext.scan.loop import check_unroll, hlo_text, xla_rng_kept
from torch_xla_ext.scan.cache import CACHE, CacheInfo, CacheKey, autocast_state, fingerprint
from torch_xla_ext.scan.cotangents import StepCotangents
from torch_xla_ext.scan.inline import inline_scan
from torch_xla_ext.scan.nested import (fake_tensors_active, outer_trace_set_aside,
                                       unrolled_because, warn_no_step_cotangents, warn_unrolled)
from torch_xla_ext.scan.sharding import operand_specs, unsharded_specs
from torch_xla_ext.scan.traced import Traced
from torch_xla_ext.scan.tracing import trace

__all__ = ["scan", "lower", "Lowered", "cache_info", "cache_clear", "CacheInfo",
           "StepCotangents", "default_partition"]


def scan(fn: Callable, init, xs, partition_fn: Callable = policies.save_everything,
         is_fn_pure: bool | None = None, *, reverse: bool = False, unroll: int | bool = 1,
         step_cotangents: StepCotangents | None = None):
    """Loops `fn(carry, x) -> (carry, y)` over the leading dim of `xs`.

    Returns `(carry, ys)` where each `ys` leaf stacks the per-step `y` leaves on a
    new dim 0; `reverse=True` runs from the last slice to the first (`ys` stays in
    `xs` order). Gradients flow to `init`, `xs` and every tensor `fn` reads from
    its closure or its module. `partition_fn` chooses what the forward loop
    keeps for the backward loop: a policy of `torch_xla_ext.policies`
    (`save_everything`, the default; `save_nothing`, `save_dots`,
    `save_only(*names)`, `offload(*names)` with names given by
    `checkpoint_name`), a policy's name, or any AOTAutograd partitioner.

    `unroll=k` (an int, 1 or more) runs k steps of `fn` in each iteration of
    the While loop, as `jax.lax.scan`'s: fewer iterations, each with more work
    for XLA to fuse and schedule, at the cost of a step compiled k times. When
    the length is not a multiple of k, the steps left over run after the loop,
    unrolled. `unroll=True` unrolls every step (`False` is 1). The results,
    gradients included, are those of `unroll=1`; the backward loop is unrolled
    alike. Every `unroll` shares one trace of `fn`; each builds loops of its own.

    `fn` is assumed pure: traced once per cache key, then replayed from the
    cache without running its Python body. The key is what can change the
    traced program, never `fn`'s identity, so a lambda or closure made afresh at
    each call from the same code over the same objects shares one trace:

    - the input structures and avals (shape, dtype, requires_grad), and the
      caller's autocast state;
    - `fn` itself (and `partition_fn`) by a fingerprint: code, closure cells,
      defaults and keyword defaults, `functools.partial` arguments, the object
      a method is bound to, recursively. In those, plain constants count by
      type and value (True, 1 and 1.0 differ), XLA tensors by aval (a new tensor
      of the same aval shares the trace), modules by identity and their
      submodules' `training` flags, other objects by identity. The key holds
      every object weakly: the cache keeps nothing alive, and its entry goes when
      one dies. An `fn` holding an object that is neither comparable by value
      nor weakly referenceable is traced at every call (with a warning). The
      very function object of an earlier call also reuses its trace whatever
      its lists, dicts and sets now hold, so that a list it appends to does
      not make it trace again.

    Tensors `fn` creates are baked into the trace; tensors it captures are read
    afresh at every call: those it reaches through its closure, defaults,
    partial arguments or bound object are found again on this call's `fn` by
    the same path (the module's current `weight`, or the new tensor a new
    closure holds); others (globals) must be the very tensors seen when tracing.
    What the key leaves out is assumed unchanged: globals `fn` reads, and the
    attributes of objects held by identity other than the `training` flags.
    Pass `is_fn_pure=False` for an `fn` whose traced program can change for the
    same key (it reads a global flag, say): it is then traced at every call and
    nothing is cached.

    In-place writes end as in the for loop. A captured tensor `fn` writes (a
    counter, an average, a BatchNorm's running statistics in training mode) is
    carried from step to step and holds its final value after the call; an `x`
    slice `fn` writes is written into `xs`. Both are carried without gradients:
    writing to a tensor that requires grad, or a value that requires grad,
    raises, as do resizing and writing a tensor that shares memory with another
    input. A write to the carry counts within its step; `init` is never written.

    Saved-tensor hooks around the call (`torch.autograd.graph.save_on_cpu`,
    `saved_tensors_hooks`) receive what scan keeps for its backward: its input
    tensors themselves and the activations the forward loop stacks, never a
    tensor of `fn`'s trace; hooks `fn` sets in its own body do not run. Under
    `torch.autocast`, `fn` is traced with the caller's autocast state; a carry
    whose dtype autocast changes (a linear layer's bf16 output) raises a
    TypeError: cast it back to the dtype of `init`.

    Nested scans (a scan called inside the `fn` of another, or in the forward
    of a `LayerStack` layer) run as loops of their own, a While loop in the
    outer loop's body, as in `jax.lax.scan`: the inner `fn` is traced once and
    cached, its step compiled once whatever its length, and its
    `partition_fn` and `unroll` shape its own loops. An inner scan runs as
    its for loop instead, unrolled into the outer step, where its `fn` draws
    random numbers, writes in place to what it captures or to its xs slices,
    is traced at every call (`is_fn_pure=False`), or has no steps; it then
    warns (`NestedScanWarning`) if given a `partition_fn` or `unroll`, which
    have no effect. `lower` of a nested scan raises: lower the outer one.

    `step_cotangents` (a `StepCotangents`) is for callers whose ys are values
    the steps also use, as a for loop's per-step values are: the backward
    then gives it, when it asks, the cotangent each step gave each stacked
    y, which no slice of `ys` gets (see `cotangents`). A nested scan warns
    (`NestedScanWarning`) that it has no effect there.
    """
    partition_fn = policies.resolve(partition_fn)
    _check_fn(fn, is_fn_pure)
    unroll = check_unroll(unroll, "scan")
    if is_tracing():
        if step_cotangents is not None:
            warn_no_step_cotangents(fn)
        return _nested_scan(fn, init, xs, partition_fn, is_fn_pure, reverse, unroll)
    call = _Call(fn, init, xs, partition_fn, is_fn_pure)
    return call.run(fn, partition_fn, reverse, unroll, nested=False,
                    cotangents=step_cotangents)


def _nested_scan(fn, init, xs, partition_fn, is_fn_pure, reverse, unroll):
    """A scan inside another scan's fn (see `nested`): its trace is found or
    made apart from the outer trace, but its loops run within it."""
    with outer_trace_set_aside():
        call = _Call(fn, init, xs, partition_fn, is_fn_pure, nested=True)
        unrolled = unrolled_because(call.length, call.traced, call.cacheable)
        if unrolled is None and call.needs_grad:
            call.traced.training_plan(fn, partition_fn, call.captures,
                                      call.carry_leaves + call.xs_leaves)
    if unrolled is not None:
        warn_unrolled(unrolled, fn, partition_fn, unroll)
        # Within the outer trace, which holds the RNG state.
        return inline_scan(fn, init, xs, reverse)
    return call.run(fn, partition_fn, reverse, unroll, nested=True)


def _check_fn(fn, is_fn_pure) -> None:
    if not callable(fn):
        raise TypeError(f"scan: fn must be callable, got {type(fn).__name__} {fn!r}")
    if is_fn_pure not in (None, True, False):
        raise TypeError(f"scan: is_fn_pure must be None, True or False, got {is_fn_pure!r}")


class _Call:
    """One call's inputs and its trace: from the cache, else traced now (or
    None: a nested call on fake tensors); `nested`, see `CacheKey.nested`."""

    def __init__(self, fn, init, xs, partition_fn, is_fn_pure, nested: bool = False):
        self.init = init
        self.carry_leaves, self.carry_tree = flatten_inputs(init, "init")
        self.xs_leaves, xs_tree = flatten_inputs(xs, "xs")
        self.length = scan_length(self.xs_leaves, xs_tree)
        cacheable = is_fn_pure is not False
        fn_key = partition_key = None
        if cacheable:
            fn_key = fingerprint(fn, "fn", nested)
            partition_key = fingerprint(partition_fn, "partition_fn")
            cacheable = fn_key is not None and partition_key is not None
        # A nested scan's loops keep no shardings of their own: the outer step's
        # propagate into them (AOTAutograd's fake tensors have none to read).
        specs = unsharded_specs if nested else operand_specs
        key = CacheKey(
            fn_key, partition_key, self.carry_tree, xs_tree, avals(self.carry_leaves, nested),
            tuple(Aval(tuple(x.shape[1:]), x.dtype, keyed_grad(x, nested))
                  for x in self.xs_leaves),
            autocast_state(), specs(self.carry_leaves), specs(self.xs_leaves), nested)
        self.cacheable = cacheable
        found = CACHE.lookup(key, fn) if cacheable else None
        # AOTAutograd's differentiation of an outer step calls a nested scan on
        # fake tensors, on which fn cannot be traced: only an earlier trace serves.
        if found is None and nested and fake_tensors_active():
            self.traced, self.captures = None, []
        elif found is None:
            with xla_rng_kept(self.carry_leaves + self.xs_leaves):
                new_trace = trace(key, fn)
                self.traced = Traced(key, new_trace, fn)
            self.captures = new_trace.lifter.captured
            if cacheable:
                CACHE.store(key, self.traced, fn)
        else:
            self.traced, self.captures = found
        self.needs_grad = torch.is_grad_enabled() and (nested or any(
            t.requires_grad for t in (*self.carry_leaves, *self.xs_leaves, *self.captures)))

    def run(self, fn, partition_fn, reverse: bool, unroll, nested: bool,
            cotangents: StepCotangents | None = None):
        """`(carry, ys)` of this call, as the caller's structures."""
        if self.length == 0:
            return self.init, self.traced.y_tree.unflatten(
                [empty_stack(a, self.carry_leaves + self.xs_leaves) for a in self.traced.y_avals])
        carry_out, ys = self.traced.run(fn, partition_fn, self.carry_leaves, self.xs_leaves,
                                        self.captures, reverse, unroll, self.needs_grad, nested,
                                        cotangents)
        # Scanning placeholders stages out HLO; its results must then guard reads like them.
        mark_derived((carry_out, ys),
                     placeholder_sources((self.carry_leaves, self.xs_leaves, self.captures)))
        return self.carry_tree.unflatten(carry_out), self.traced.y_tree.unflatten(ys)


@dataclasses.dataclass(frozen=True)
class Lowered:
    """The HLO a scan would run: its forward loop, and its backward loop when
    the call would need gradients (else None)."""
    forward_hlo: str
    backward_hlo: str | None
    device_kind: str


def lower(fn: Callable, init, xs, partition_fn: Callable = policies.save_everything,
          is_fn_pure: bool | None = None, *, reverse: bool = False, unroll: int | bool = 1,
          device_kind: str | None = None) -> Lowered:
    """Stages `scan(fn, init, xs, ...)` without running it and returns the HLO
    text of its loops as they would run on `device_kind` ("TPU", "CPU", ...;
    default: the current device's kind).

    Nothing is transferred or executed: `init` and `xs` may be placeholders or
    real tensors, of which only shapes, dtypes and `requires_grad` count, and
    tensors `fn` captures are read only for their avals. This is how to see what
    a TPU would run (an `offload` policy's host placements, say) on a machine
    without one."""
    partition_fn = policies.resolve(partition_fn, "lower")
    _check_fn(fn, is_fn_pure)
    unroll = check_unroll(unroll, "lower")
    if is_tracing():
        raise NotImplementedError(
            f"lower: called while another scan traces its fn ({tracing_what()}); lowering "
            f"nested scans on their own is not supported, since a nested scan's loop is part "
            f"of the outer step's HLO. Lower the outer scan to see it, or call lower outside "
            f"the outer fn")
    if device_kind is None:
        device_kind = torch_xla.runtime.device_type()
    if not isinstance(device_kind, str) or not device_kind:
        raise TypeError(f"lower: device_kind must be a str such as 'TPU' or 'CPU', "
                        f"got {device_kind!r}")
    init, xs = as_placeholders(init, "init"), as_placeholders(xs, "xs")
    call = _Call(fn, init, xs, partition_fn, is_fn_pure)
    if call.length == 0:
        raise ValueError("lower: xs has 0 steps; a scan of no steps runs no loop")
    with xla_rng_kept(call.carry_leaves + call.xs_leaves):
        forward, backward = call.traced.loops(fn, partition_fn, call.captures, call.needs_grad,
                                              device_kind.upper())
    return Lowered(hlo_text(forward.computation(call.length, reverse, unroll)),
                   None if backward is None
                   else hlo_text(backward.computation(call.length, not reverse, unroll)),
                   device_kind.upper())


def cache_info() -> CacheInfo:
    """Hits, misses and size of the cache of traced scan bodies."""
    return CACHE.info()


def cache_clear() -> None:
    """Empties the cache of traced scan bodies and resets its statistics."""
    CACHE.clear()


class _CallableModule(types.ModuleType):
    """`torch_xla_ext.scan` is this module (its stages stay reachable as
    `torch_xla_ext.scan.cache`, ...) and, called, the `scan` function."""

    def __call__(self, fn, init, xs, *args, **kwargs):
        return scan(fn, init, xs, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
