"""A traced fn: the results of its passes, and the loops made from it."""
from __future__ import annotations

import functools
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
from torch_xla_ext.scan.loop import Loop, lower_body, xla_rng_kept
from torch_xla_ext.scan.sharding import (constrained, operand_specs, spec_sharding,
                                         unsharded_specs)
from torch_xla_ext.scan.signature import CallLayout, pick, split_list
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
        self.capture_avals = avals(captured, key.nested)
        self.capture_specs = self._specs(captured)
        self.y_tree = trace.y_tree
        self.y_avals = avals(trace.y_out)
        capture_in = [trace.lifter.stand_ins[id(t)] for t in captured]
        self.written = mutation.find_writes(
            trace.lifter.writes, trace.carry_arg, trace.x_arg, key.x_avals, capture_in, captured,
            lambda i: mutation.describe_x(key.xs_tree, i),
            lambda i: mutation.describe_capture(fn, captured, i))
        self.writes_back = self.written.any_written_back()  # asked at every call
        read_only = passes.read_only_carries(trace.carry_out, trace.carry_arg,
                                             self.written.carry)
        y_sources = passes.ys_passed_from_xs(trace.y_out, trace.x_arg, self.written.x)
        self.layout = CallLayout.of(read_only, len(captured), self.written.captures, y_sources,
                                    len(key.x_avals), self.written.x)
        self.loop_carry_avals, _, self.loop_invariant_avals = self.layout.loop_inputs(
            key.carry_avals, key.x_avals, self.capture_avals)
        _, self.loop_stacked_avals = self.layout.loop_outputs(
            key.carry_avals, self.capture_avals, self.y_avals, key.x_avals)
        # The sharding of each loop input's operand, and the sharding the loop
        # keeps for it (a sliced input's, per slice; None where it has none).
        self.input_specs = self.layout.loop_inputs(key.carry_specs, key.x_specs,
                                                   self.capture_specs)
        carries, sliced, invariants = self.input_specs
        self.input_shardings = (
            [spec_sharding(spec) for spec in carries],
            [spec_sharding(spec, leading_dropped=True) for spec in sliced],
            [spec_sharding(spec) for spec in invariants])
        # Lowered now, so that the cache keeps no lazy tensors (pending work
        # that reads placeholders) once tracing is over.
        self._inference = InferencePlan(self, trace, capture_in)
        self._training: dict[bool, TrainingPlan] = {}
        self._lock = threading.Lock()

    def bind_captures(self, fn) -> list[torch.Tensor] | None:
        """The tensors that this call's `fn` captures, in trace order, or None
        when one is gone or no longer has its traced aval or sharding (so fn
        must be traced afresh)."""
        captures = []
        for binding, aval in zip(self._capture_bindings, self.capture_avals):
            tensor = binding() if isinstance(binding, weakref.ref) else resolve(fn, binding)
            if (not isinstance(tensor, torch.Tensor) or tensor.device.type != "xla"
                    or Aval.of(tensor, self.key.nested) != aval):
                return None
            captures.append(tensor)
        if self._specs(captures) != self.capture_specs:
            return None
        return captures

    def _specs(self, tensors) -> tuple[str, ...]:
        return unsharded_specs(tensors) if self.key.nested else operand_specs(tensors)

    def output_shardings(self) -> list:
        """The sharding each output of a forward step keeps (None: as XLA
        propagates): a carry its input's, an x slice fn writes its xs leaf's
        slice; a y, computed from those, none of its own."""
        carries, sliced, _ = self.input_shardings
        return carries + [None] * len(self.layout.stacked_y) + pick(sliced,
                                                                    self.layout.written_x)

    def run(self, fn, partition_fn, carry, xs, captures, reverse, unroll, needs_grad,
            nested: bool = False, cotangents=None):
        """One call; `fn` and `partition_fn` are this call's, used (not kept) if
        the training plan is built now. `unroll` shapes the loops only: every
        unroll shares this trace, each keeps its own loops' HLO. `nested`: the
        call is in another scan's trace (see `nested`). With `cotangents` (a
        `StepCotangents`, which a nested call never has), the call runs the
        tapped training plan."""
        if self.writes_back:
            self._check_written_unaliased(fn, carry, xs, captures)
        if not needs_grad:
            return self._inference(carry, xs, captures, reverse, unroll)
        plan = self.training_plan(fn, partition_fn, captures, [*carry, *xs],
                                  tapped=cotangents is not None)
        return plan(carry, xs, captures, reverse, unroll, nested, cotangents)

    @property
    def uses_seed(self) -> bool:
        """Whether the step draws random numbers (its loop takes a seed per step)."""
        return self._inference.loop.uses_seed

    def training_plan(self, fn, partition_fn, captures, inputs,
                      tapped: bool = False) -> TrainingPlan:
        """The forward and backward loops, built on first need from this
        call's `fn`, `partition_fn` and captures; `inputs`: its carry and xs.
        `tapped`: the plan whose backward can also give the steps' cotangents
        of their ys (`StepCotangents`), built apart."""
        with self._lock:
            if tapped not in self._training:
                with xla_rng_kept(inputs):
                    self._training[tapped] = TrainingPlan(
                        self, fn, partition_fn, captures, torch_xla.runtime.device_type(),
                        tapped)
        return self._training[tapped]

    def loops(self, fn, partition_fn, captures, needs_grad, device_kind) -> tuple:
        """The loops a call would run on `device_kind`: (forward, backward or
        None), built afresh (for looking at their HLO, not kept)."""
        if not needs_grad:
            return self._inference.loop, None
        plan = TrainingPlan(self, fn, partition_fn, captures, device_kind)
        return plan.forward_loop, plan.backward_loop

    def _check_written_unaliased(self, fn, carry, xs, captures):
        inputs = [*carry, *xs, *captures]
        descriptions = (
            [functools.partial(self.key.carry_tree.leaf_path, "init", i) for i in range(len(carry))]
            + [functools.partial(mutation.describe_x, self.key.xs_tree, i) for i in range(len(xs))]
            + [functools.partial(mutation.describe_capture, fn, captures, i)
               for i in range(len(captures))])
        _, x_positions, capture_positions = split_list(range(len(inputs)), [len(carry), len(xs)])
        written = ([x_positions[i] for i in self.layout.written_x]
                   + [capture_positions[i] for i in self.layout.written_captures])
        mutation.check_unaliased(inputs, written, lambda position: descriptions[position]())

    def loop_inputs(self, carry, xs, captures) -> tuple[list, list, list]:
        """A loop's carries, sliced inputs and invariants for this call. The
        tensors fn writes go in as `mutation.unaliased` values, which the
        write-back after the loop leaves as they are (autograd may keep them)."""
        return self.layout.loop_inputs(carry, xs, captures, written=mutation.unaliased)

    def assemble(self, carry, xs, captures, loop_carry_out, loop_stacked):
        """The full carry and ys from what a loop computed and what the passes
        kept out of it; writes the new values of the tensors fn writes in place
        into them."""
        carry_out, ys, written_values = self.layout.call_outputs(carry, xs, loop_carry_out,
                                                                 loop_stacked)
        if self.writes_back:
            mutation.write_back(self.layout.written_inputs(xs, captures), written_values,
                                placeholder_sources((carry, xs, captures)))
        return carry_out, ys


class InferencePlan:
    """Forward only: the trace itself, lowered once."""

    def __init__(self, traced: Traced, trace: Trace, capture_in):
        self.traced = traced
        layout = traced.layout
        carries_out, stacked_out = layout.loop_outputs(trace.carry_out, capture_in, trace.y_out,
                                                       trace.x_arg)
        outputs = constrained(carries_out + stacked_out, traced.output_shardings())
        carries_in, sliced_in, given = layout.loop_inputs(trace.carry_in, trace.x_in, capture_in)
        # Inputs by their values before fn ran (fn may have written them).
        carries_in, sliced_in = split_list(
            trace.lifter.writes.originals(carries_in + sliced_in, outputs), [len(carries_in)])
        signature = layout.signature()
        body = lower_body("scan_step", outputs, signature.input_slots(carries_in, sliced_in, given),
                          len(given))
        self.constants = body.constants
        self.loop = Loop("scan", body, signature.output_slots(), traced.loop_carry_avals,
                         traced.key.x_avals, traced.loop_stacked_avals,
                         traced.loop_invariant_avals + list(avals(body.constants)))

    def __call__(self, carry, xs, captures, reverse, unroll):
        carries, sliced, invariants = self.traced.loop_inputs(carry, xs, captures)
        carry_out, stacked = self.loop(carries, sliced, invariants + self.constants, reverse,
                                       unroll)
        return self.traced.assemble(carry, xs, captures, carry_out, stacked)
