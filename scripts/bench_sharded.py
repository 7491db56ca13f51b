#!/usr/bin/env python
"""What one device holds and sends in a sharded training step: a
LlamaForCausalLM as transformers builds it ("loop") against the same model
converted by `stack_layers`, on SPMD's virtual devices (PJRT CPU,
CPU_NUM_DEVICES, 8 by default).

Meshes (each made from the runtime's device count, so the same code runs on a
pod's devices as on the virtual ones):

* fsdp:        a 1-D mesh 'fsdp' of every device, the model wrapped in torch_xla's
               `SpmdFullyShardedDataParallel` (its logits sharded on the batch);
* fsdp-units:  the same mesh, the model wrapped as transformers' Trainer wraps it
               (`wrap_model_xla_fsdp`, `fsdp_config={"xla": True, "xla_fsdp_v2":
               True, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}`): a
               unit per layer unconverted, the stack inside the model's unit converted;
* fsdp+model:  a 2-D mesh 'fsdp' x 'model' (devices / --model-devices x
               --model-devices), weights sharded by hand with `mark_sharding`:
               q/k/v/gate/up column-parallel and o/down row-parallel on 'model',
               their other dimension on 'fsdp' (the layer dimension whole), the
               embedding and the head their vocabulary on 'model' and hidden
               size on 'fsdp', the batch on 'fsdp';
* model:       a 1-D mesh 'model' of every device, the same tensor-parallel
               weights, the batch whole.

--specs runs fsdp+model once per set of weight shardings a user may give it
(`SPEC_SETS`, labelled fsdp+model:SET): megatron (above), tensor-only (the
'model' half), fsdp-only (the 'fsdp' half), both-axes (one dimension over
('fsdp', 'model')) and with-norms (megatron, the norms cut on 'model'). With
--model-devices 3 no dimension of the default sizes divides evenly on 'model'.

Policies: save_everything (the default), save_nothing (stack_layers'
`partition_fn`) and checkpointing (`gradient_checkpointing_enable()` on the
converted model, which recomputes as save_nothing does); the loop runs
save_everything, and checkpointing with torch_xla's checkpoint around each
layer (torch's does not run on XLA), which save_nothing is compared with.

Each (mesh, policy, mode) runs in a fresh process (scripts/harness.py, within
--timeout seconds): `--steps` SGD steps on a batch of --batch sequences of
--seq tokens, with XLA's optimized HLO dumped (`--xla_dump_to`). From the
step's module (the largest one compiled):

* device MiB:   XLA's "Total bytes used" on one device (buffer assignment):
                parameters, gradients, activations and temporaries;
* collectives:  all-gather, all-reduce, reduce-scatter, all-to-all and
                collective-permute in the partitioned HLO, each inside a loop
                counted once per iteration, and their bytes (results' on one device);
* whole-stack gathers: all-gathers whose result is a whole stacked [L, ...] weight;
* compile s:    XLA compile time over all steps;
* loss:         the last step's loss (the two modes compute the same steps).

The ratios stack_layers/loop of device bytes and collective bytes have the
goal <= 1.0 for every mesh and policy, and a mesh no whole-stack gather in
any policy (the losses, in the table, are the same in both modes); with
--rounds N, each (mesh, policy, mode) runs N times and compile times are the
rounds' medians (the bytes and counts of a compiled program do not vary).

  python scripts/bench_sharded.py --markdown           # every mesh and policy, L=3
  python scripts/bench_sharded.py --meshes fsdp --policies save_everything
  python scripts/bench_sharded.py --devices 4 --meshes fsdp+model --policies save_everything \
      --specs megatron,tensor-only,fsdp-only,both-axes,with-norms
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import harness  # first: it sets the default device before torch_xla is imported

MODES = ("loop", "stack_layers")
MESHES = ("fsdp", "fsdp-units", "fsdp+model", "model")
POLICIES = ("save_everything", "save_nothing", "checkpointing")
# The loop's program under each policy: it recomputes the same with either.
LOOP_POLICY = {"save_everything": "save_everything", "save_nothing": "checkpointing",
               "checkpointing": "checkpointing"}
BYTES_GOAL = 1.0
DEFAULT_TIMEOUT = 900
WORKLOAD_OPTIONS = ("steps", "devices", "model_devices", "layers",
                    *harness.LLAMA_SIZE_OPTIONS, "seq", "batch")
# The sizes (a Llama whose every weight is cut 8 ways).
DEFAULT_SIZES = {"layers": 3, "hidden": 64, "heads": 4, "kv_heads": 1, "intermediate": 160,
                 "vocab": 128, "seq": 56, "batch": 8}
# The role of each weight of a layer (and the embedding's, the head's) in
# tensor parallelism: which dimension of a [out, in] weight a spec cuts.
ROLES = {"q_proj": "column", "k_proj": "column", "v_proj": "column", "gate_proj": "column",
         "up_proj": "column", "embed_tokens": "column", "lm_head": "column",
         "o_proj": "row", "down_proj": "row", "input_layernorm": "norm",
         "post_attention_layernorm": "norm", "norm": "norm"}
# Weight shardings a user may give the fsdp+model mesh, by role (a role a set
# leaves out stays replicated): Megatron's (tensor parallel on 'model', the
# other dimension on 'fsdp'), either half of it alone, both axes
# on one dimension, and Megatron's with the norms cut too. The 1-D 'model'
# mesh takes tensor-only.
SPEC_SETS = {
    "megatron": {"column": ("model", "fsdp"), "row": ("fsdp", "model")},
    "tensor-only": {"column": ("model", None), "row": (None, "model")},
    "fsdp-only": {"column": (None, "fsdp"), "row": ("fsdp", None)},
    "both-axes": {"column": (("fsdp", "model"), None), "row": (None, ("fsdp", "model"))},
    "with-norms": {"column": ("model", "fsdp"), "row": ("fsdp", "model"), "norm": ("model",)},
}


def runs(meshes, policies) -> list[tuple[str, str, str]]:
    """(mesh, policy, mode) of every worker, the loop's policies once each."""
    chosen = []
    for mesh in meshes:
        for policy in policies:
            chosen.append((mesh, policy, "stack_layers"))
            loop = (mesh, LOOP_POLICY[policy], "loop")
            if loop not in chosen:
                chosen.append(loop)
    return sorted(chosen, key=lambda run: (meshes.index(run[0]), POLICIES.index(run[1]),
                                           MODES.index(run[2])))


# ---------------------------------------------------------------- worker side


def weight_spec(name: str, spec_set: dict) -> tuple | None:
    """The partition spec `spec_set` (one of `SPEC_SETS`) gives one layer's
    weight `name` (or the embedding's, the head's), by its role; None for
    what stays replicated."""
    module = name.removesuffix(".weight").rsplit(".", 1)[-1]
    return spec_set.get(ROLES.get(module))


def spec_set_of(mesh_label: str) -> tuple[str, str]:
    """(mesh, spec set) of a run's mesh label: 'fsdp+model:tensor-only', or a
    mesh alone (fsdp+model with Megatron's specs, model with tensor-only)."""
    mesh, _, spec_set = mesh_label.partition(":")
    return mesh, spec_set or ("tensor-only" if mesh == "model" else "megatron")


def shard_by_hand(model, mesh, spec_set: dict) -> None:
    """Marks every weight of `model` with `weight_spec` (a layer's weight: the
    stacked tensor its Parameter is a view of, with the layer dimension whole)."""
    import torch_xla.distributed.spmd as xs

    for name, param in model.named_parameters():
        spec = weight_spec(name, spec_set)
        if spec is not None:
            xs.mark_sharding(param, mesh, spec)  # a stacked layer's: its stacked tensor


def make_model(args):
    """The model of `args.mode` under `args.policy` (the same weights in every mode)."""
    import functools

    import torch
    import torch_xla.utils.checkpoint as xla_checkpoint
    import transformers

    from torch_xla_ext import stack_layers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(harness.llama_config(args, use_cache=False))
    if args.mode == "loop":
        if args.policy == "checkpointing":
            model._set_gradient_checkpointing(
                enable=True, gradient_checkpointing_func=functools.partial(
                    xla_checkpoint.checkpoint, use_reentrant=True))
    elif args.policy == "save_nothing":
        stack_layers(model, partition_fn="save_nothing")
    else:
        stack_layers(model)
        if args.policy == "checkpointing":
            model.gradient_checkpointing_enable()
    return model


def sharded(model, args):
    """`model` on the device, sharded as `args.mesh` says; returns the module
    to call and the mesh and partition spec of the input ids."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    devices = xr.global_runtime_device_count()
    mesh_name, spec_set = spec_set_of(args.mesh)
    if mesh_name in ("fsdp", "fsdp-units"):
        mesh = xs.Mesh(np.arange(devices), (devices,), ("fsdp",))
        xs.set_global_mesh(mesh)  # as the Trainer does with xla_fsdp_v2
        model.to(torch_xla.device())
        return fsdp_wrapped(model, args), mesh, ("fsdp", None)
    if mesh_name == "fsdp+model":
        if devices % args.model_devices:
            raise SystemExit(f"--model-devices {args.model_devices} does not divide the "
                             f"{devices} devices")
        mesh = xs.Mesh(np.arange(devices), (devices // args.model_devices, args.model_devices),
                       ("fsdp", "model"))
        ids_spec = ("fsdp", None)
    else:
        mesh = xs.Mesh(np.arange(devices), (devices,), ("model",))
        ids_spec = (None, None)
    xs.set_global_mesh(mesh)  # where a stack finds the data axes of the hidden state
    model.to(torch_xla.device())
    shard_by_hand(model, mesh, SPEC_SETS[spec_set])
    return model, mesh, ids_spec


def fsdp_wrapped(model, args):
    """`model` in FSDPv2: around it whole (fsdp), or as the Trainer wraps it (fsdp-units)."""
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        SpmdFullyShardedDataParallel)

    if spec_set_of(args.mesh)[0] == "fsdp":
        return SpmdFullyShardedDataParallel(
            model, shard_output=lambda output, mesh: xs.mark_sharding(
                output.logits, mesh, ("fsdp", None, None)))
    import transformers
    from transformers.integrations.tpu import wrap_model_xla_fsdp

    training = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), fsdp=True, report_to=[],
        fsdp_config={"xla": True, "xla_fsdp_v2": True,
                     "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    return wrap_model_xla_fsdp(model, training, True)


def run_worker(args) -> dict:
    """One (mesh, policy, mode) in this process, its HLO dumped to a
    directory of its own; returns the figures."""
    dump = tempfile.mkdtemp(prefix="bench_sharded_")
    # Read when the runtime starts, at the first device use below.
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [
        os.environ.get("XLA_FLAGS"), f"--xla_dump_to={dump}", "--xla_dump_hlo_as_text"]))
    os.environ["CPU_NUM_DEVICES"] = str(args.devices)
    try:
        return measured_steps(args, dump)
    finally:
        shutil.rmtree(dump, ignore_errors=True)


def measured_steps(args, dump: str) -> dict:
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    from torch_xla_ext.layer_stack import StackedList
    from torch_xla_ext.metrics.hlo import collective_totals, collectives, dumped_modules

    xr.use_spmd()
    model = make_model(args)
    stacked_shapes = {tuple(tensor.shape) for module in model.modules()
                      if isinstance(module, StackedList) for stack in module.stacks()
                      for tensor in stack.storage.stacked.values()}
    module, mesh, ids_spec = sharded(model, args)
    module.train()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    ids = ids.to(torch_xla.device())
    xs.mark_sharding(ids, mesh, ids_spec)
    losses = []
    for _ in range(args.steps):
        loss = module(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch_xla.sync()
        losses.append(loss.item())
    step = max(dumped_modules(dump), key=lambda m: len(m.optimized_hlo))
    totals = collective_totals(step.optimized_hlo)
    whole_stack = [c for c in collectives(step.optimized_hlo) if c.kind == "all-gather"
                   and _array_dims(c.shape) in stacked_shapes]
    _, compile_ns, _ = met.metric_data("CompileTime") or (0, 0, None)
    return {
        "device_bytes": step.bytes_used,
        "collectives": totals,
        "collective_count": sum(kind["count"] for kind in totals.values()),
        "collective_bytes": sum(kind["bytes"] for kind in totals.values()),
        "whole_stack_gathers": sum(c.runs for c in whole_stack),
        "compile_s": compile_ns / 1e9,
        "losses": losses,
    }


def _array_dims(shape: str) -> tuple | None:
    """The dimensions of an HLO array shape ("f32[3,64,64]{2,1,0}"); None for a tuple."""
    if shape.startswith("("):
        return None
    dims = shape[shape.index("[") + 1:shape.index("]")]
    return tuple(int(size) for size in dims.split(",") if size)


# ---------------------------------------------------------------- parent side


def mesh_labels(meshes: list[str], spec_sets: list[str]) -> list[str]:
    """The meshes to run, fsdp+model once per spec set (labelled
    'fsdp+model:SET' unless the set is only Megatron's)."""
    if spec_sets == ["megatron"]:
        return meshes
    return [label for mesh in meshes for label in (
        [f"{mesh}:{spec_set}" for spec_set in spec_sets] if mesh == "fsdp+model" else [mesh])]


def print_runs(outcomes, markdown: bool) -> None:
    """A line per (mesh, policy, mode): its figures, or the status of a run that gave none."""
    from torch_xla_ext.metrics.hlo import COLLECTIVE_KINDS
    from torch_xla_ext.metrics.table import render_rows

    rows: list = [["mesh", "policy", "mode", "device MiB", "collectives", "coll. MiB",
                   "ag/ar/rs/a2a/cp", "whole-stack gathers", "compile s", "loss"], None]
    for (mesh, policy, mode), outcome in outcomes.items():
        figures = outcome.figures
        if figures is None:
            rows.append([mesh, policy, mode, outcome.status])
            continue
        kinds = "/".join(str(figures["collectives"][kind]["count"]) for kind in COLLECTIVE_KINDS)
        rows.append([mesh, policy, mode, f"{figures['device_bytes'] / 2**20:.2f}",
                     str(figures["collective_count"]),
                     f"{figures['collective_bytes'] / 2**20:.2f}", kinds,
                     str(figures["whole_stack_gathers"]), f"{figures['compile_s']:.2f}",
                     f"{figures['losses'][-1]:.5f}"])
    print(render_rows(rows, markdown))


def goals(rounds, meshes, policies) -> list:
    """stack_layers/loop of device bytes and collective bytes per mesh and
    policy (goal <= 1.0), and the whole-stack gathers per mesh (none)."""
    checked = []
    last = rounds[-1]  # counts and bytes, the same in every round
    for mesh in meshes:
        for policy in policies:
            converted = (mesh, policy, "stack_layers")
            unconverted = (mesh, LOOP_POLICY[policy], "loop")
            for figure, what in (("device_bytes", "device bytes"),
                                 ("collective_bytes", "collective bytes")):
                checked.append(harness.goal_over_rounds(
                    f"{what} stack_layers/loop, {mesh} {policy}", rounds, converted,
                    unconverted, figure, BYTES_GOAL))
        gathers = [last[mesh, policy, "stack_layers"]["whole_stack_gathers"]
                   for policy in policies if (mesh, policy, "stack_layers") in last]
        checked.append(harness.Goal(f"whole-stack gathers, {mesh}",
                                    sum(gathers) if len(gathers) == len(policies) else None, 0))
    return checked


def main(argv: list[str] | None = None) -> None:
    parser = harness.benchmark_parser(__file__, __doc__)
    parser.add_argument("--meshes", default=",".join(MESHES),
                        help=f"comma-separated meshes among {', '.join(MESHES)}")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated policies among {', '.join(POLICIES)}")
    parser.add_argument("--specs", default="megatron",
                        help=f"comma-separated weight shardings of the fsdp+model mesh, each "
                             f"run as a mesh of its own, among {', '.join(SPEC_SETS)} "
                             f"(default megatron)")
    parser.add_argument("--devices", type=harness.positive_int, default=8,
                        help="virtual CPU devices (CPU_NUM_DEVICES; default 8)")
    parser.add_argument("--model-devices", type=harness.positive_int, default=2,
                        help="devices of the 'model' axis of the fsdp+model mesh (default 2)")
    parser.add_argument("--steps", type=harness.positive_int, default=2)
    parser.add_argument("--layers", type=harness.positive_int)
    harness.add_llama_size_options(parser)
    parser.add_argument("--seq", type=harness.positive_int)
    parser.add_argument("--batch", type=harness.positive_int)
    parser.set_defaults(**DEFAULT_SIZES)
    parser.add_argument("--mesh", help=argparse.SUPPRESS)
    parser.add_argument("--policy", choices=POLICIES, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    harness.add_rounds_option(parser)
    harness.add_worker_options(parser, DEFAULT_TIMEOUT)
    args = parser.parse_args(argv)

    if args.worker:
        harness.report_result(run_worker(args))
        return

    meshes, policies = args.meshes.split(","), args.policies.split(",")
    spec_sets = args.specs.split(",")
    for chosen, known, option in ((meshes, MESHES, "--meshes"), (policies, POLICIES, "--policies"),
                                  (spec_sets, SPEC_SETS, "--specs")):
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            parser.error(f"{option}: unknown {unknown}; choose from {', '.join(known)}")
    meshes = mesh_labels(meshes, spec_sets)
    print(f"PJRT {harness.device_name()}, {args.devices} devices, {args.layers} layers, "
          f"{harness.llama_description(args)}, seq {args.seq}, batch {args.batch}, SGD, "
          f"{args.steps} steps", flush=True)
    every_round = []
    for number in range(1, args.rounds + 1):
        outcomes = {}
        for mesh, policy, mode in runs(meshes, policies):
            outcomes[mesh, policy, mode] = harness.measure(
                os.path.abspath(__file__),
                ["--worker", "--mesh", mesh, "--policy", policy, "--mode", mode,
                 *harness.passed_on(args, WORKLOAD_OPTIONS)],
                args.timeout, f"{mesh} {policy} {mode}")
        print("\nSharded training step" + (f", round {number} of {args.rounds}"
                                           if args.rounds > 1 else ""))
        print_runs(outcomes, args.markdown)
        every_round.append(outcomes)
    print("\nRatios" + (f", median of {args.rounds} rounds (spread):" if args.rounds > 1
                         else ":"))
    figures = [{run: o.figures for run, o in outcomes.items() if o.ok}
               for outcomes in every_round]
    print(harness.goal_table(goals(figures, meshes, policies), args.markdown))
    harness.exit_on_problems(parser.prog, [harness.failure_summary(
        {" ".join(run): outcome for outcomes in every_round for run, outcome in outcomes.items()})])


if __name__ == "__main__":
    main()
