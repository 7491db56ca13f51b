"""A traced fn: the results of its passes, and the loops made from it."""
from __future__ import annotations

import threading
import weakref

import torch
import torch_xla.runtime

from torch_xla_ext.placeholders import placeholder_sources
from torch_xla_ext.scan import mutation, passes
from torch_xla_ext.scan.autograd import TrainingPlan
from torch_xla_ext.scan.avals import Aval, avals
from torch_xla_ext.scan.cache import CacheKey
from torch_xla_ext.object_graph import find_paths, resolve
from torch_xla_ext.scan.loop import Loop, Slot, lower_body
from torch_xla_ext.scan.tracing import Trace


class Traced:
    """What one trace of `fn` knows: its captures (held weakly), output structure,
    and, built on first need, the inference loop and the training loops for
    each scan length and direction."""

    def __init__(self, key: CacheKey, trace: Trace, fn):
        self.key = key
        captured = trace.lifter.captured
        # How a later call finds its captures: by the path from its fn to each
        # (a lambda made afresh over the same module reads the module's
        # current weight), else by a weak reference to the tensor itself.
        self._capture_bindings = [weakref.ref(t) if path is None else path
                                  for t, path in zip(captured, find_paths(fn, captured))]
        self.capture_avals = avals(captured)
        self.y_tree = trace.y_tree
        self.y_avals = avals(trace.y_out)
        capture_in = [trace.lifter.stand_ins[id(t)] for t in captured]
        self.written = mutation.find_writes(
            trace.lifter.writes, trace.carry_arg, trace.x_arg, key.x_avals, capture_in, captured,
            lambda i: mutation.describe_x(key.xs_tree, i),
            lambda i: mutation.describe_capture(fn, captured, i))
        self.read_only = passes.read_only_carries(trace.carry_out, trace.carry_arg,
                                                  self.written.carry)
        self.y_from_x = passes.ys_passed_from_xs(trace.y_out, trace.x_arg, self.written.x)
        self.looped_carry = [i for i, ro in enumerate(self.read_only) if not ro]
        self.read_only_carry = [i for i, ro in enumerate(self.read_only) if ro]
        self.stacked_y = [i for i, source in enumerate(self.y_from_x) if source is None]
        self.invariant_captures = [i for i in range(len(captured))
                                   if i not in self.written.captures]
        # A loop carries the looped carries, then the captures fn writes; it
        # stacks the ys, then the x slices fn writes; its invariants are the
        # read-only carries, then the other captures.
        self.loop_carry_avals = (
            [key.carry_avals[i] for i in self.looped_carry]
            + [self.capture_avals[i] for i in self.written.captures])
        self.loop_stacked_avals = (
            [self.y_avals[i] for i in self.stacked_y] + [key.x_avals[i] for i in self.written.x])
        self.loop_invariant_avals = (
            [key.carry_avals[i] for i in self.read_only_carry]
            + [self.capture_avals[i] for i in self.invariant_captures])
        # Lowered now, so that the cache keeps no lazy tensors (pending work
        # that reads placeholders) once tracing is over.
        self._inference = InferencePlan(self, trace, capture_in)
        self._training = None
        self._lock = threading.Lock()

    def bind_captures(self, fn) -> list[torch.Tensor] | None:
        """The tensors that this call's `fn` captures, in trace order, or None
        when one is gone or no longer has its traced aval (so fn must be traced
        afresh)."""
        captures = []
        for binding, aval in zip(self._capture_bindings, self.capture_avals):
            tensor = binding() if isinstance(binding, weakref.ref) else resolve(fn, binding)
            if (not isinstance(tensor, torch.Tensor) or tensor.device.type != "xla"
                    or Aval.of(tensor) != aval):
                return None
            captures.append(tensor)
        return captures

    def run(self, fn, partition_fn, carry, xs, captures, reverse, needs_grad):
        """One call; `fn` and `partition_fn` are this call's, used (not kept) if
        the training plan is built now."""
        if self.written.any_written_back():
            self._check_written_unaliased(fn, carry, xs, captures)
        if not needs_grad:
            return self._inference(carry, xs, captures, reverse)
        with self._lock:
            if self._training is None:
                self._training = TrainingPlan(self, fn, partition_fn, captures,
                                              torch_xla.runtime.device_type())
        return self._training(carry, xs, captures, reverse)

    def loops(self, fn, partition_fn, captures, needs_grad, device_kind) -> tuple:
        """The loops a call would run on `device_kind`: (forward, backward or
        None), built afresh (for looking at their HLO, not kept)."""
        if not needs_grad:
            return self._inference.loop, None
        plan = TrainingPlan(self, fn, partition_fn, captures, device_kind)
        return plan.forward_loop, plan.backward_loop

    def _check_written_unaliased(self, fn, carry, xs, captures):
        inputs = [*carry, *xs, *captures]
        n_carry, n_x = len(carry), len(xs)

        def describe(position):
            if position < n_carry:
                return f"{self.key.carry_tree.leaf_path('init', position)}"
            if position < n_carry + n_x:
                return mutation.describe_x(self.key.xs_tree, position - n_carry)
            return mutation.describe_capture(fn, captures, position - n_carry - n_x)

        mutation.check_unaliased(
            inputs, [n_carry + i for i in self.written.x]
            + [n_carry + n_x + i for i in self.written.captures], describe)

    def loop_inputs(self, carry, xs, captures) -> tuple[list, list, list]:
        """A loop's carries, sliced inputs and invariants for this call. The
        tensors fn writes go in as `mutation.unaliased` values, which the
        write-back after the loop leaves as they are (autograd may keep them)."""
        carries = ([carry[i] for i in self.looped_carry]
                   + [mutation.unaliased(captures[i]) for i in self.written.captures])
        sliced = [mutation.unaliased(x) if i in self.written.x else x for i, x in enumerate(xs)]
        invariants = ([carry[i] for i in self.read_only_carry]
                      + [captures[i] for i in self.invariant_captures])
        return carries, sliced, invariants

    def assemble(self, carry, xs, captures, loop_carry_out, loop_stacked):
        """The full carry and ys from what a loop computed and what the passes
        kept out of it; writes the new values of the tensors fn writes in place
        into them."""
        n_looped, n_stacked_y = len(self.looped_carry), len(self.stacked_y)
        carry_out = list(carry)
        for i, value in zip(self.looped_carry, loop_carry_out):
            carry_out[i] = value
        ys = [None] * len(self.y_avals)
        for i, value in zip(self.stacked_y, loop_stacked):
            ys[i] = value
        for i, source in enumerate(self.y_from_x):
            if source is not None:
                ys[i] = xs[source]
        if self.written.any_written_back():
            mutation.write_back(
                [captures[i] for i in self.written.captures] + [xs[i] for i in self.written.x],
                list(loop_carry_out[n_looped:]) + list(loop_stacked[n_stacked_y:]),
                placeholder_sources((carry, xs, captures)))
        return carry_out, ys


class InferencePlan:
    """Forward only: the trace itself, lowered once."""

    def __init__(self, traced: Traced, trace: Trace, capture_in):
        self.traced = traced
        written = traced.written
        outputs = ([trace.carry_out[i] for i in traced.looped_carry]
                   + [capture_in[i] for i in written.captures]
                   + [trace.y_out[i] for i in traced.stacked_y]
                   + [trace.x_arg[i] for i in written.x])
        # Inputs by their values before fn ran (fn may have written them).
        n_x = len(trace.x_in)
        originals = trace.lifter.writes.originals(
            [trace.carry_in[i] for i in traced.looped_carry]
            + [capture_in[i] for i in written.captures] + list(trace.x_in), outputs)
        given = ([trace.carry_in[i] for i in traced.read_only_carry]
                 + [capture_in[i] for i in traced.invariant_captures])
        slots = {}
        for tensors, kind in ((originals[:-n_x], "carry"), (originals[-n_x:], "sliced"),
                              (given, "invariant")):
            for position, t in enumerate(tensors):
                if t is not None:  # None: an input fn overwrote without reading it
                    slots[id(t)] = (t, Slot(kind, position))
        body = lower_body("scan_step", outputs, slots, len(given))
        self.constants = body.constants
        out_slots = ([Slot("carry", p) for p in range(len(traced.loop_carry_avals))]
                     + [Slot("stacked", p) for p in range(len(traced.loop_stacked_avals))])
        self.loop = Loop("scan", body, out_slots, traced.loop_carry_avals, traced.key.x_avals,
                         traced.loop_stacked_avals,
                         traced.loop_invariant_avals + list(avals(body.constants)))

    def __call__(self, carry, xs, captures, reverse):
        carries, sliced, invariants = self.traced.loop_inputs(carry, xs, captures)
        carry_out, stacked = self.loop(carries, sliced, invariants + self.constants, reverse)
        return self.traced.assemble(carry, xs, captures, carry_out, stacked)
