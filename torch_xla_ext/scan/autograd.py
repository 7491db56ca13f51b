"""The autograd plan: forward and backward While loops from AOTAutograd's
partitioned graphs, joined by one `torch.autograd.Function`."""
from __future__ import annotations

import functools

import torch
import torch_xla
from functorch.compile import aot_function, make_boxed_func
from torch._decomp import get_decompositions
from torch_xla.experimental.stablehlo_custom_call import place_to_device, place_to_host

from torch_xla_ext import policies
from torch_xla_ext.placeholders import placeholder_sources, tracing
from torch_xla_ext.scan import mutation, passes
from torch_xla_ext.scan.avals import avals, flatten
from torch_xla_ext.scan.loop import Loop, Slot, lower_body
from torch_xla_ext.scan.sharding import as_fn_arguments, functional_mark_sharding
from torch_xla_ext.scan.tracing import LiftCaptures, call_body, internal, new_stand_in, stand_in

# torch_xla 2.9's native_dropout scales kept values by 1 / p instead of
# 1 / (1 - p) (its eager dropout is right): traced graphs use torch's
# decomposition, a comparison of uniform draws with p.
_DECOMPOSITIONS = get_decompositions([torch.ops.aten.native_dropout])

# Device kinds with a host memory apart from the device's, where offloaded
# activations go (annotate_device_placement kills a PJRT CPU process).
HOST_MEMORY_KINDS = frozenset(["TPU", "CUDA", "GPU"])


def output_nodes(graph_module) -> list:
    output = next(n for n in reversed(graph_module.graph.nodes) if n.op == "output")
    return list(output.args[0])


class TrainingPlan:
    """Forward and backward loops from AOTAutograd's partitioned graphs.

    Inputs of one step: looped carries (then the captures fn writes, carried
    without gradients), x slices and invariants (read-only carries, then the
    other captures); see `Traced`. The forward loop also stacks the activations the
    backward graph needs, except those it can get for free: slices of `xs` are
    read from `xs` itself, and values computed from invariants alone or from an
    x slice by layout ops alone (a weight's transpose) are recomputed in the
    backward step instead of stacked. Activations an `offload` policy names
    go to host memory on `device_kind`s that have one.
    """

    def __init__(self, traced, fn, partition_fn, captured, device_kind: str):
        """`fn`, `partition_fn` and the tensors `fn` captures are the building
        call's; the plan does not keep them."""
        self.traced = traced
        offloaded = getattr(partition_fn, "offloaded", ())
        if offloaded and device_kind not in HOST_MEMORY_KINDS:
            policies.warn_no_host_memory(partition_fn, device_kind)
            offloaded = ()
        key = traced.key
        carry_avals, invariant_avals = traced.loop_carry_avals, traced.loop_invariant_avals
        any_grad = any(a.requires_grad for a in (*key.carry_avals, *key.x_avals, *invariant_avals))
        # Gradients flow through every floating carry, whichever input asked for
        # them, but not through the captures fn writes.
        carry_grad = [a.dtype.is_floating_point and any_grad and i < len(traced.looped_carry)
                      for i, a in enumerate(carry_avals)]
        self.input_avals = ([a._replace(requires_grad=g) for a, g in zip(carry_avals, carry_grad)]
                            + list(key.x_avals) + invariant_avals)
        self.sizes = (len(carry_avals), len(key.x_avals), len(invariant_avals))
        fw_graph, bw_graph, differentiable = self._partition(fn, partition_fn, captured)
        self._build_loops(fw_graph, bw_graph, differentiable, offloaded)

    def _step(self, fn, captured, *primals):
        """One step as a flat function of (loop carries, x, invariants) for
        AOTAutograd, returning (loop carry outs, stacked outputs)."""
        traced, key = self.traced, self.traced.key
        written = traced.written
        n_carry, n_x, _ = self.sizes
        n_looped, n_read_only = len(traced.looped_carry), len(traced.read_only_carry)
        x, invariants = primals[n_carry:n_carry + n_x], primals[n_carry + n_x:]
        full_carry = [None] * len(key.carry_avals)
        for i, value in zip(traced.looped_carry, primals[:n_looped]):
            full_carry[i] = value
        for i, value in zip(traced.read_only_carry, invariants):
            full_carry[i] = value
        captures = [None] * len(captured)
        for i, value in zip(written.captures, primals[n_looped:n_carry]):
            captures[i] = value
        for i, value in zip(traced.invariant_captures, invariants[n_read_only:]):
            captures[i] = value
        full_carry, x = as_fn_arguments(full_carry), as_fn_arguments(x)
        # fn writes to copies of its inputs: AOTAutograd would make writes to
        # its own inputs outputs of its graphs.
        full_carry = [t.clone() if w else t for t, w in zip(full_carry, written.carry)]
        x = [t.clone() if i in written.x else t for i, t in enumerate(x)]
        captures = [t.clone() if i in written.captures else t for i, t in enumerate(captures)]
        stand_ins = {id(c): v for c, v in zip(captured, captures)}
        with LiftCaptures(list(primals) + full_carry + x, stand_ins):
            carry_out, y_out = call_body(fn, key.carry_tree.unflatten(full_carry),
                                          key.xs_tree.unflatten(x))
        carry_out = flatten(carry_out)[0]
        y_out = flatten(y_out)[0]
        for i in written.captures:
            mutation.check_written(captures[i], traced.capture_avals[i], False,
                                   mutation.describe_capture(fn, captured, i))
        for i in written.x:
            mutation.check_written(x[i], key.x_avals[i], False,
                                   mutation.describe_x(key.xs_tree, i))
        outputs = ([carry_out[i] for i in traced.looped_carry]
                   + [captures[i] for i in written.captures]
                   + [y_out[i] for i in traced.stacked_y]
                   + [x[i] for i in written.x])
        # AOTAutograd keeps outputs that alias inputs out of its graphs; copies
        # keep them in (XLA removes the copy).
        return tuple(o.clone() if o._is_view() or any(o is p for p in primals) else o
                     for o in outputs)

    def _partition(self, fn, partition_fn, captured):
        graphs = {}

        def keep(name):
            def compiler(graph, _inputs):
                graphs[name] = graph
                return make_boxed_func(graph)
            return compiler

        compiled = aot_function(functools.partial(self._step, fn, captured),
                                fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                                partition_fn=partition_fn, decompositions=_DECOMPOSITIONS)
        primals = [new_stand_in(a.shape, a.dtype, a.requires_grad, guarded=False)
                   for a in self.input_avals]
        # AOTAutograd traces fn again: under the autocast state of the first trace.
        with (torch.enable_grad(), internal(self.traced.key.autocast),
              tracing("scan's fn (differentiated)"), functional_mark_sharding()):
            outputs = compiled(*primals)
            differentiable = [o.requires_grad for o in outputs]
            roots = [o for o in outputs if o.requires_grad]
            if roots:
                torch.autograd.backward(roots, [new_stand_in(o.shape, o.dtype, guarded=False)
                                                for o in roots])
        if "backward" not in graphs:
            raise ValueError("scan: none of fn's outputs depends on an input that requires grad")
        return graphs["forward"], graphs["backward"], differentiable

    def _build_loops(self, fw_graph, bw_graph, differentiable, offloaded):
        stand_ins = [stand_in(a, requires_grad=False) for a in self.input_avals]
        outputs, activations, saved_sources = self._build_forward_loop(fw_graph, stand_ins,
                                                                       offloaded)
        self._build_backward_loop(bw_graph, differentiable, stand_ins, outputs, activations,
                                  saved_sources)

    def _build_forward_loop(self, fw_graph, stand_ins, offloaded):
        """Lowers the forward graph; returns its lazy outputs, the activations it
        stacks, and where the backward step gets each saved value. The
        activations `checkpoint_name` named in `offloaded` are placed in host
        memory as they are stacked."""
        n_carry, n_x, n_inv = self.sizes
        n_stacked = len(self.traced.loop_stacked_avals)
        n_out = n_carry + n_stacked
        carry_in, x_in = stand_ins[:n_carry], stand_ins[n_carry:n_carry + n_x]
        invariants_in = stand_ins[n_carry + n_x:]
        slots = {}
        for i, t in enumerate(carry_in):
            slots[id(t)] = (t, Slot("carry", i))
        for i, t in enumerate(x_in):
            slots[id(t)] = (t, Slot("sliced", i))
        for i, t in enumerate(invariants_in):
            slots[id(t)] = (t, Slot("invariant", i))
        # The graph's ops already carry autocast's casts: replayed without autocast.
        with torch.no_grad(), internal(), tracing("scan's forward step"):
            fw_outputs = fw_graph(*stand_ins)
        outputs, saved = list(fw_outputs[:n_out]), list(fw_outputs[n_out:])

        saved_nodes = output_nodes(fw_graph)[n_out:]
        saved_sources, activations = passes.classify_saved(
            saved, saved_nodes, fw_graph, carry_in, x_in)
        self.offloaded = [what for (kind, what), node in zip(saved_sources, saved_nodes)
                          if kind == "stacked" and node.target is policies.NAMED_OP
                          and node.args[1] in offloaded]
        with torch.no_grad():
            activations = [place_to_host(a) if i in self.offloaded else a
                           for i, a in enumerate(activations)]

        forward_body = lower_body("scan_forward_step", outputs + activations, slots, n_inv)
        self.forward_constants = forward_body.constants
        out_slots = ([Slot("carry", i) for i in range(n_carry)]
                     + [Slot("stacked", i) for i in range(n_stacked + len(activations))])
        self.activation_count = len(activations)
        self.forward_loop = Loop(
            "scan_forward", forward_body, out_slots, self.input_avals[:n_carry],
            self.input_avals[n_carry:n_carry + n_x],
            avals(outputs[n_carry:]) + avals(activations),
            self.input_avals[n_carry + n_x:] + list(avals(forward_body.constants)))
        return outputs, activations, saved_sources

    def _build_backward_loop(self, bw_graph, differentiable, stand_ins, outputs, activations,
                             saved_sources):
        """Lowers the backward graph. Its loop carries the carry gradients, then
        accumulators for invariant gradients; its sliced inputs are activations,
        y gradients and xs."""
        n_carry, n_x, n_inv = self.sizes
        x_in, invariants_in = stand_ins[n_carry:n_carry + n_x], stand_ins[n_carry + n_x:]
        self.carry_tangents = [i for i in range(n_carry) if differentiable[i]]
        self.y_tangents = [i for i in range(len(self.traced.loop_stacked_avals))
                           if differentiable[n_carry + i]]
        self.grad_x = [i for i in range(n_x) if self.input_avals[n_carry + i].requires_grad]
        self.grad_invariants = [i for i in range(n_inv)
                                if self.input_avals[n_carry + n_x + i].requires_grad]
        bw_slots = {}
        activation_in = [stand_in(a, False) for a in avals(activations)]
        for i, t in enumerate(activation_in):
            bw_slots[id(t)] = (t, Slot("sliced", i))
        with torch.no_grad():  # offloaded activations come back just before use
            activation_in = [place_to_device(t) if i in self.offloaded else t
                             for i, t in enumerate(activation_in)]
        y_tangent_in = []
        for position, i in enumerate(self.y_tangents):
            t = stand_in(avals(outputs)[n_carry + i], False)
            bw_slots[id(t)] = (t, Slot("sliced", len(activations) + position))
            y_tangent_in.append(t)
        x_offset = len(activations) + len(self.y_tangents)
        for i, t in enumerate(x_in):
            bw_slots[id(t)] = (t, Slot("sliced", x_offset + i))
        for i, t in enumerate(invariants_in):
            bw_slots[id(t)] = (t, Slot("invariant", i))
        carry_tangent_in = []
        for position, i in enumerate(self.carry_tangents):
            t = stand_in(self.input_avals[i], False)
            bw_slots[id(t)] = (t, Slot("carry", position))
            carry_tangent_in.append(t)
        saved_in = []
        for kind, what in saved_sources:
            saved_in.append(x_in[what] if kind == "x" else what if kind == "recomputed"
                            else activation_in[what])
        tangents = carry_tangent_in + y_tangent_in
        with torch.no_grad(), internal(), tracing("scan's backward step"):
            grads = list(bw_graph(*saved_in, *tangents))
        grads = [g if g is not None else torch.zeros(a.shape, dtype=a.dtype, device=x_in[0].device)
                 for g, a in zip(grads, self.input_avals)]
        grad_outputs = ([grads[i] for i in self.carry_tangents]
                        + [grads[n_carry + n_x + i] for i in self.grad_invariants]
                        + [grads[n_carry + i] for i in self.grad_x])
        backward_body = lower_body("scan_backward_step", grad_outputs, bw_slots, n_inv)
        self.backward_constants = backward_body.constants
        n_tangent_carry = len(self.carry_tangents)
        bw_out_slots = ([Slot("carry", i) for i in range(n_tangent_carry)]
                        + [Slot("accumulate", n_tangent_carry + i)
                           for i in range(len(self.grad_invariants))]
                        + [Slot("stacked", i) for i in range(len(self.grad_x))])
        invariant_avals = self.input_avals[n_carry + n_x:]
        self.backward_loop = Loop(
            "scan_backward", backward_body, bw_out_slots,
            [self.input_avals[i] for i in self.carry_tangents]
            + [invariant_avals[i] for i in self.grad_invariants],
            list(avals(activations)) + [avals(outputs)[n_carry + i] for i in self.y_tangents]
            + list(self.input_avals[n_carry:n_carry + n_x]),
            [self.input_avals[n_carry + i] for i in self.grad_x],
            list(invariant_avals) + list(avals(backward_body.constants)))

    def __call__(self, carry, xs, captures, reverse):
        carries, sliced, invariants = self.traced.loop_inputs(carry, xs, captures)
        results = _ScanFunction.apply(self, reverse, *carries, *sliced, *invariants)
        n_carry = self.sizes[0]
        return self.traced.assemble(carry, xs, captures, results[:n_carry], results[n_carry:])

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


def _sync_only(tensors: list) -> None:
    """Runs the pending computations of `tensors` (and no other), without
    waiting. torch_xla's own entry point, not the placeholder guard around it:
    the guard would discard, with a warning, what this call's trace still
    holds, though only `tensors` run."""
    sync_multi = torch_xla._XLAC._xla_sync_multi
    getattr(sync_multi, "__wrapped__", sync_multi)(tensors, devices=[], wait=False)


class _ScanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: TrainingPlan, reverse: bool, *inputs):
        outputs, activations = plan.forward(inputs, reverse)
        ctx.plan, ctx.reverse = plan, reverse
        if (torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
                and not placeholder_sources(inputs)):
            # The caller's saved-tensor hooks may read what is saved (save_on_cpu
            # copies it to the host): the loop runs once for all its results,
            # not once for each tensor a hook reads.
            _sync_only([*outputs, *activations])
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
