"""A traced fn: the results of its passes, and the loops made from it."""
from __future__ import annotations

import threading
import weakref

import torch

from torch_xla_ext.scan import passes
from torch_xla_ext.scan.autograd import TrainingPlan
from torch_xla_ext.scan.avals import Aval, avals
from torch_xla_ext.scan.cache import CacheKey
from torch_xla_ext.scan.paths import find_paths, resolve
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
        self.read_only = passes.read_only_carries(trace.carry_out, trace.carry_arg)
        self.y_from_x = passes.ys_passed_from_xs(trace.y_out, trace.x_arg)
        self.looped_carry = [i for i, ro in enumerate(self.read_only) if not ro]
        self.read_only_carry = [i for i, ro in enumerate(self.read_only) if ro]
        self.stacked_y = [i for i, source in enumerate(self.y_from_x) if source is None]
        capture_in = [trace.lifter.stand_ins[id(t)] for t in trace.lifter.captured]
        # Lowered now, so that the cache keeps no lazy tensors (pending work
        # that reads placeholders) once tracing is over.
        self._inference = InferencePlan(self, trace.carry_in, trace.x_in, capture_in,
                                        trace.carry_out, trace.y_out)
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
        if not needs_grad:
            return self._inference(carry, xs, captures, reverse)
        with self._lock:
            if self._training is None:
                self._training = TrainingPlan(self, fn, partition_fn, captures)
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


class InferencePlan:
    """Forward only: the trace itself, lowered once."""

    def __init__(self, traced: Traced, carry_in, x_in, capture_in, carry_out, y_out):
        self.traced = traced
        slots = {}
        for position, i in enumerate(traced.looped_carry):
            slots[id(carry_in[i])] = (carry_in[i], Slot("carry", position))
        for i, x in enumerate(x_in):
            slots[id(x)] = (x, Slot("sliced", i))
        given = [carry_in[i] for i in traced.read_only_carry] + list(capture_in)
        for k, t in enumerate(given):
            slots[id(t)] = (t, Slot("invariant", k))
        outputs = ([carry_out[i] for i in traced.looped_carry]
                   + [y_out[i] for i in traced.stacked_y])
        body = lower_body("scan_step", outputs, slots, len(given))
        self.constants = body.constants
        out_slots = ([Slot("carry", p) for p in range(len(traced.looped_carry))]
                     + [Slot("stacked", p) for p in range(len(traced.stacked_y))])
        self.loop = Loop("scan", body, out_slots,
                         [traced.key.carry_avals[i] for i in traced.looped_carry],
                         traced.key.x_avals, [traced.y_avals[i] for i in traced.stacked_y],
                         avals(given) + avals(body.constants))

    def __call__(self, carry, xs, captures, reverse):
        traced = self.traced
        invariants = [carry[i] for i in traced.read_only_carry] + list(captures) + self.constants
        carry_out, stacked = self.loop([carry[i] for i in traced.looped_carry], xs, invariants,
                                       reverse)
        return traced.assemble(carry, xs, carry_out, stacked)

