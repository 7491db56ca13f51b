"""The autograd plan: forward and backward While loops from AOTAutograd's
partitioned graphs, joined by one `torch.autograd.Function`."""
from __future__ import annotations

import dataclasses
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
from torch_xla_ext.scan.loop import Loop, lower_body
from torch_xla_ext.scan.signature import Signature, pick, place, split_list
from torch_xla_ext.scan.batch_dims import batch_dims
from torch_xla_ext.scan.cotangents import StepCotangents, Taps
from torch_xla_ext.scan.sharding import (
    as_fn_arguments, constrained, data_parallel_devices, functional_mark_sharding, split_along)
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
    go to host memory on `device_kind`s that have one. With `tapped`, the
    backward can also stack the cotangents the steps give their ys
    (`cotangents`), in a loop of its own.
    """

    def __init__(self, traced, fn, partition_fn, captured, device_kind: str,
                 tapped: bool = False):
        """`fn`, `partition_fn` and the tensors `fn` captures are the building
        call's; the plan does not keep them."""
        self.traced = traced
        self.taps = Taps(traced.y_avals, traced.layout.stacked_y) if tapped else None
        offloaded = getattr(partition_fn, "offloaded", ())
        if offloaded and device_kind not in HOST_MEMORY_KINDS:
            policies.warn_no_host_memory(partition_fn, device_kind)
            offloaded = ()
        key = traced.key
        carry_avals, invariant_avals = traced.loop_carry_avals, traced.loop_invariant_avals
        any_grad = any(a.requires_grad for a in (*key.carry_avals, *key.x_avals, *invariant_avals))
        # Gradients flow through every floating carry, whichever input asked for
        # them, but not through the captures fn writes.
        carry_grad = [a.dtype.is_floating_point and any_grad
                      and i < len(traced.layout.looped_carry) for i, a in enumerate(carry_avals)]
        self.input_avals = ([a._replace(requires_grad=g) for a, g in zip(carry_avals, carry_grad)]
                            + list(key.x_avals) + invariant_avals)
        self.signature = traced.layout.signature()
        fw_graph, bw_graph, differentiable = self._partition(fn, partition_fn, captured)
        self._build_loops(fw_graph, bw_graph, differentiable, offloaded)

    def _step(self, fn, captured, *primals):
        """One step as a flat function of (loop carries, x, invariants, and
        with taps their sinks) for AOTAutograd, returning (loop carry outs,
        stacked outputs)."""
        traced, key = self.traced, self.traced.key
        written = traced.written
        inputs = primals[:len(self.input_avals)]
        if self.taps is not None:
            inputs = self.taps.enter(inputs, primals[len(self.input_avals):])
        full_carry, x, captures = traced.layout.call_inputs(
            *self.signature.split_inputs(inputs))
        full_carry, x = as_fn_arguments(full_carry), as_fn_arguments(x)
        # fn writes to copies of its inputs: AOTAutograd would make writes to
        # its own inputs outputs of its graphs.
        full_carry = [t.clone() if w else t for t, w in zip(full_carry, written.carry)]
        x = [t.clone() if i in written.x else t for i, t in enumerate(x)]
        captures = [t.clone() if i in written.captures else t for i, t in enumerate(captures)]
        stand_ins = {id(c): v for c, v in zip(captured, captures)}
        with LiftCaptures(list(primals) + list(inputs) + full_carry + x, stand_ins):
            carry_out, y_out = call_body(fn, key.carry_tree.unflatten(full_carry),
                                          key.xs_tree.unflatten(x))
        carry_out = flatten(carry_out)[0]
        y_out = flatten(y_out)[0]
        if self.taps is not None:
            self.taps.watch(y_out)
        for i in written.captures:
            mutation.check_written(captures[i], traced.capture_avals[i], False,
                                   mutation.describe_capture(fn, captured, i))
        for i in written.x:
            mutation.check_written(x[i], key.x_avals[i], False,
                                   mutation.describe_x(key.xs_tree, i))
        carries, stacked = traced.layout.loop_outputs(carry_out, captures, y_out, x)
        outputs = carries + stacked
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
        sink_avals = [] if self.taps is None else self.taps.sink_avals
        primals = [new_stand_in(a.shape, a.dtype, a.requires_grad, guarded=False)
                   for a in self.input_avals + sink_avals]
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
        # The sinks, which no step reads, only fill the graphs' places for them.
        self.sink_stand_ins = [] if self.taps is None else [
            stand_in(a, requires_grad=False) for a in self.taps.sink_avals]
        outputs, activations, saved_sources = self._build_forward_loop(fw_graph, stand_ins,
                                                                       offloaded)
        self._build_backward_loop(bw_graph, differentiable, stand_ins, outputs, activations,
                                  saved_sources)

    def _build_forward_loop(self, fw_graph, stand_ins, offloaded):
        """Lowers the forward graph; returns its lazy outputs, the activations it
        stacks, and where the backward step gets each saved value. The
        activations `checkpoint_name` named in `offloaded` are placed in host
        memory as they are stacked."""
        signature = self.signature
        carry_in, x_in, invariants_in = signature.split_inputs(stand_ins)
        slots = signature.input_slots(carry_in, x_in, invariants_in)
        # The graph's ops already carry autocast's casts: replayed without autocast.
        with torch.no_grad(), internal(), tracing("scan's forward step"):
            fw_outputs = fw_graph(*stand_ins, *self.sink_stand_ins)
        n_out = signature.carries + signature.stacked
        outputs, saved = split_list(fw_outputs, [n_out])

        saved_nodes = output_nodes(fw_graph)[n_out:]
        saved_sources, activations = passes.classify_saved(
            saved, saved_nodes, fw_graph, carry_in, x_in)
        self.offloaded = [source.index for source, node in zip(saved_sources, saved_nodes)
                          if isinstance(source, passes.Stacked)
                          and node.target is policies.NAMED_OP and node.args[1] in offloaded]
        self.activation_shardings = self._batch_split_activations(
            fw_graph, [node for source, node in zip(saved_sources, saved_nodes)
                       if isinstance(source, passes.Stacked)])
        activations = constrained(activations, self.activation_shardings)
        with torch.no_grad():
            activations = [place_to_host(a) if i in self.offloaded else a
                           for i, a in enumerate(activations)]

        forward_body = lower_body(
            "scan_forward_step", constrained(outputs, self.traced.output_shardings()) + activations,
            slots, signature.invariants)
        self.forward_constants = forward_body.constants
        carry_avals, x_avals, invariant_avals = signature.split_inputs(self.input_avals)
        _, stacked_avals = signature.split_outputs(avals(outputs))
        forward_signature = dataclasses.replace(signature,
                                                stacked=signature.stacked + len(activations))
        self.forward_loop = Loop(
            "scan_forward", forward_body, forward_signature.output_slots(), carry_avals, x_avals,
            stacked_avals + list(avals(activations)),
            invariant_avals + list(avals(forward_body.constants)))
        return outputs, activations, saved_sources

    def _batch_split_activations(self, fw_graph, activation_nodes) -> list:
        """Under data parallelism (`batch_dims`), the split of each activation
        along the dimension holding the batch, which the forward loop stacks
        and the backward loop reads; None for one without it, or otherwise."""
        carry_specs, _, invariant_specs = self.traced.input_specs
        placeholders = [node for node in fw_graph.graph.nodes if node.op == "placeholder"]
        carry_nodes, _, invariant_nodes = self.signature.split_inputs(
            placeholders[:len(self.input_avals)])
        inputs = list(zip(carry_nodes + invariant_nodes, carry_specs + invariant_specs))
        devices = {data_parallel_devices(spec) for _, spec in inputs} - {None}
        if len(devices) != 1:
            return [None] * len(activation_nodes)
        devices, = devices
        parts = len(devices)
        sources = [node for node, spec in inputs if data_parallel_devices(spec) == devices]
        batches = {node.meta["val"].shape[0] for node in sources}
        if len(batches) != 1 or next(iter(batches)) % parts:
            return [None] * len(activation_nodes)
        dims = batch_dims(fw_graph, dict.fromkeys(sources, 0), batches.pop())
        shardings = []
        for index, node in enumerate(activation_nodes):
            shape, dim = node.meta["val"].shape, dims.get(node)
            shardings.append(split_along(devices, len(shape), dim)
                             if dim is not None and shape[dim] % parts == 0
                             and index not in self.offloaded else None)
        return shardings

    def _build_backward_loop(self, bw_graph, differentiable, stand_ins, outputs, activations,
                             saved_sources):
        """Lowers the backward graph. Its loop carries the carry gradients, then
        accumulators for invariant gradients; its sliced inputs are activations,
        y gradients and xs; it stacks the xs gradients."""
        signature = self.signature
        _, x_in, invariants_in = signature.split_inputs(stand_ins)
        carry_avals, x_avals, invariant_avals = signature.split_inputs(self.input_avals)
        _, stacked_avals = signature.split_outputs(avals(outputs))
        carry_differentiable, stacked_differentiable = signature.split_outputs(differentiable)
        self.carry_tangents = [i for i, d in enumerate(carry_differentiable) if d]
        self.y_tangents = [i for i, d in enumerate(stacked_differentiable) if d]
        self.grad_x = [i for i, a in enumerate(x_avals) if a.requires_grad]
        self.grad_invariants = [i for i, a in enumerate(invariant_avals) if a.requires_grad]
        self.backward_signature = Signature(
            carries=len(self.carry_tangents) + len(self.grad_invariants),
            sliced=len(activations) + len(self.y_tangents) + len(x_in),
            invariants=len(invariants_in), stacked=len(self.grad_x))

        activation_in = [stand_in(a, False) for a in avals(activations)]
        y_tangent_in = [stand_in(stacked_avals[i], False) for i in self.y_tangents]
        carry_tangent_in = [stand_in(carry_avals[i], False) for i in self.carry_tangents]
        bw_slots = self.backward_signature.input_slots(
            carry_tangent_in, activation_in + y_tangent_in + x_in, invariants_in)
        with torch.no_grad():  # offloaded activations come back just before use
            activation_in = [place_to_device(t) if i in self.offloaded else t
                             for i, t in enumerate(activation_in)]
        activation_in = constrained(activation_in, self.activation_shardings)
        saved_in = [source.read(x_in, activation_in) for source in saved_sources]
        with torch.no_grad(), internal(), tracing("scan's backward step"):
            grads = list(bw_graph(*saved_in, *carry_tangent_in, *y_tangent_in))
        sink_avals = [] if self.taps is None else self.taps.sink_avals
        grads = [g if g is not None else torch.zeros(a.shape, dtype=a.dtype, device=x_in[0].device)
                 for g, a in zip(grads, self.input_avals + sink_avals)]
        grads, sink_grads = split_list(grads, [len(self.input_avals)])
        carry_grads, x_grads, invariant_grads = signature.split_inputs(grads)
        grad_outputs = (pick(carry_grads, self.carry_tangents)
                        + pick(invariant_grads, self.grad_invariants)
                        + pick(x_grads, self.grad_x))
        # Each gradient sharded as the input it is the gradient of.
        carry_shardings, slice_shardings, invariant_shardings = self.traced.input_shardings
        grad_outputs = constrained(grad_outputs, pick(carry_shardings, self.carry_tangents)
                                   + pick(invariant_shardings, self.grad_invariants)
                                   + pick(slice_shardings, self.grad_x))
        sliced_avals = list(avals(activations)) + pick(stacked_avals, self.y_tangents) + x_avals
        self.backward_loop = self._backward_loop("scan_backward", grad_outputs, bw_slots,
                                                 sliced_avals, pick(x_avals, self.grad_x))
        if self.taps is not None:
            # What reaches a y through its ys slice is its tangent; the rest
            # of its cotangent came from its step.
            tangents = dict(zip(self.y_tangents, y_tangent_in))
            from_step = [grad - tangents[position] if position in tangents else grad
                         for grad, position in zip(sink_grads, self.taps.positions)]
            self.tapped_backward_loop = self._backward_loop(
                "scan_backward_tapped", grad_outputs + from_step, bw_slots, sliced_avals,
                pick(x_avals, self.grad_x) + pick(stacked_avals, self.taps.positions))

    def _backward_loop(self, name: str, grad_outputs: list, slots: dict, sliced_avals: list,
                       stacked_avals: list) -> Loop:
        """A backward loop giving `grad_outputs` (the carry and invariant
        gradients, then what it stacks) from the backward step's inputs."""
        signature = self.signature
        carry_avals, _, invariant_avals = signature.split_inputs(self.input_avals)
        body = lower_body(f"{name}_step", grad_outputs, slots, signature.invariants)
        loop_signature = dataclasses.replace(self.backward_signature, stacked=len(stacked_avals))
        return Loop(
            name, body, loop_signature.output_slots(accumulated=len(self.grad_invariants)),
            pick(carry_avals, self.carry_tangents) + pick(invariant_avals, self.grad_invariants),
            sliced_avals, stacked_avals, invariant_avals + list(avals(body.constants)))

    def __call__(self, carry, xs, captures, reverse, unroll, nested: bool,
                 cotangents: StepCotangents | None = None):
        """`cotangents`: only for a plan built `tapped` (see `StepCotangents`)."""
        carries, sliced, invariants = self.traced.loop_inputs(carry, xs, captures)
        constants = self.backward_loop.body.constants
        inputs = [*carries, *sliced, *invariants]
        if nested:
            # What the loops read goes through a torch op, which the outer
            # trace sees, so that it lifts the tensors it did not make; an
            # autograd.Function's inputs and saved tensors it does not see.
            constants = [c.view_as(c) for c in constants]
            inputs = [t.view_as(t) for t in inputs]
        results = _ScanFunction.apply(self, (reverse, unroll, cotangents), constants, *inputs)
        return self.traced.assemble(carry, xs, captures, *self.signature.split_outputs(results))

    def forward(self, inputs, reverse, unroll):
        carries, xs, invariants = self.signature.split_inputs(inputs)
        carry_out, stacked = self.forward_loop(carries, xs, invariants + self.forward_constants,
                                               reverse, unroll)
        stacked_out, activations = split_list(stacked, [self.signature.stacked])
        return list(carry_out) + stacked_out, activations

    def backward(self, inputs, activations, constants, output_grads, reverse, unroll,
                 cotangents: StepCotangents | None):
        """The backward loop, unrolled as the forward one; the tapped one if
        `cotangents` are wanted, which then receive what it stacks."""
        loop = self.backward_loop
        if cotangents is not None and cotangents.wanted():
            loop = self.tapped_backward_loop
            constants = loop.body.constants
        _, xs, invariants = self.signature.split_inputs(inputs)
        carry_grads, y_grads = self.signature.split_outputs(output_grads)
        zeros = [torch.zeros(invariants[i].shape, dtype=invariants[i].dtype,
                             device=invariants[i].device) for i in self.grad_invariants]
        carries = pick(carry_grads, self.carry_tangents) + zeros
        sliced = list(activations) + pick(y_grads, self.y_tangents) + xs
        carry_out, stacked = loop(carries, sliced, invariants + list(constants), not reverse,
                                  unroll)
        tangent_grads, invariant_grads = split_list(carry_out, [len(self.carry_tangents)])
        stacked, from_step = split_list(stacked, [len(self.grad_x)])
        if loop is not self.backward_loop:
            y_leaves = place(len(self.traced.y_avals), (self.taps.y_indices, from_step))
            cotangents.receive(self.traced.y_tree.unflatten(y_leaves))
        signature = self.signature
        return (place(signature.carries, (self.carry_tangents, tangent_grads))
                + place(signature.sliced, (self.grad_x, stacked))
                + place(signature.invariants, (self.grad_invariants, invariant_grads)))


def _sync_only(tensors: list) -> None:
    """Runs the pending computations of `tensors` (and no other), without
    waiting. torch_xla's own entry point, not the placeholder guard around it:
    the guard would discard, with a warning, what this call's trace still
    holds, though only `tensors` run."""
    sync_multi = torch_xla._XLAC._xla_sync_multi
    getattr(sync_multi, "__wrapped__", sync_multi)(tensors, devices=[], wait=False)


class _ScanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: TrainingPlan, options: tuple, constants, *inputs):
        reverse, unroll, cotangents = options
        outputs, activations = plan.forward(inputs, reverse, unroll)
        ctx.constants = constants
        ctx.plan, ctx.options = plan, options
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
        grads = ctx.plan.backward(saved[:ctx.input_count], saved[ctx.input_count:],
                                  ctx.constants, output_grads, *ctx.options)
        return (None, None, None, *grads)
