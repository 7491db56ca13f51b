#!/usr/bin/env python
"""Compare torch_xla metrics side by side.

  compare_metrics.py [run] [--layers N | --sweep-layers N,N,...] [--hidden H]
                     [--steps S] [--modes MODE,...]
                     [--workload MODULE:FUNCTION | --hf CONFIG]
                     [--json FILE] [--plot FILE.png] [--timeout SECONDS] [--op-times]

runs a training workload (by default a stack of decoder blocks; --hf a
transformers model, unconverted and converted by stack_layers) once per mode,
each mode in a fresh process (scripts/harness.py) because torch_xla's metrics
are global to a process, and prints one table: a column per mode, a row per
figure, marking the values that differ from the `loop` column by more than
10%. `run` is the default command. With --op-times, each mode then records
two more steps under torch_xla's profiler, and a second table shows where a
step's time went, op by op (`torch_xla_ext.metrics.op_times`).

  compare_metrics.py diff A.txt B.txt

reads two saved `torch_xla.debug.metrics.metrics_report()` texts and prints the
headline figures, then every counter and metric found in either, one column
per file, marking the values that differ from A by more than 10%.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import sys
import time

import harness  # first: it sets the default device before torch_xla is imported
# Nothing of torch: `diff` runs without it (the worker imports it).
from torch_xla_ext import hf_workloads
from torch_xla_ext.metrics import (
    BYTES, COUNT, FIGURE_ROWS, SECONDS, MetricsReport, MetricsReportError, Row, figures,
    format_table, hlo_parameter_count, parse_report, peak_rss_bytes, raw_figures, raw_rows)


class InputError(Exception):
    """A problem with the user's input, reported as `prog: error: ...` with exit code 2."""


class RunError(Exception):
    """A mode's worker process gave no figures; reported with exit code 1."""


def column_names(paths: list[str]) -> list[str]:
    """File names when they tell the files apart, else the paths as given."""
    base_names = [os.path.basename(path) for path in paths]
    if len(set(base_names)) == len(paths):
        return base_names
    if len(set(paths)) == len(paths):
        return list(paths)
    return [f"{path} ({position})" for position, path in enumerate(paths, start=1)]


def read_report(path: str) -> MetricsReport:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(
            f"{path}: not a text file; expected the text of metrics_report()") from None
    try:
        return parse_report(text)
    except MetricsReportError as error:
        raise InputError(f"{path} {error}") from None


def run_diff(args: argparse.Namespace) -> None:
    paths = [args.baseline_report, args.other_report]
    reports = [read_report(path) for path in paths]
    names = column_names(paths)
    rows = raw_rows(reports)
    columns = {}
    for name, report in zip(names, reports):
        raw = raw_figures(report)
        # torch_xla leaves out counters and metrics that are still zero.
        columns[name] = {**figures(report), **{row.key: raw.get(row.key, 0) for row in rows}}
    print(format_table(columns, baseline=names[0], rows=[*FIGURE_ROWS, None, *rows]))


# ---------------------------------------------------------------- run

# What each mode runs, for the help text.
MODES = {
    "loop": "a Python for loop over the layers",
    "scan": "torch_xla_ext's LayerStack: one scan, traced once on placeholders",
    "scan-device-data": "that scan traced at every step, every stand-in copied from host",
    "torch-xla-scan": "torch_xla.experimental.scan_layers",
}
# The mode a workload builds its model for: scan-device-data is `scan` with
# other stand-ins, which the worker swaps in itself.
WORKLOAD_MODES = {"loop": "loop", "scan": "scan", "scan-device-data": "scan",
                  "torch-xla-scan": "torch-xla-scan"}
BASELINE_MODE = "loop"
# What each mode runs with --hf.
HF_MODES = {
    "loop": "the model as transformers builds it (unconverted)",
    "scan": "the model converted by torch_xla_ext.stack_layers(model)",
    "scan-device-data": "that scan traced at every step, every stand-in copied from host",
    "torch-xla-scan": "torch_xla's scan_layers through a wrapper module (Llama only)",
}

# Deep enough that the scan's win shows (at 32 layers its compile is about a third
# of the loop's and its graph building a tenth), and all four modes still finish
# in well under two minutes on 2 CPU cores (about 40 s).
DEFAULT_LAYERS = 32
DEFAULT_HIDDEN = 64
DEFAULT_STEPS = 3
# Seconds a mode's process may take; the default run takes under a minute per mode.
DEFAULT_TIMEOUT = 600
DECODER_HEADS = 4
DECODER_BATCH = 2
DECODER_SEQUENCE = 16
DECODER_LEARNING_RATE = 0.01
# The built-in configs of --hf FAMILY: DECODER_HEADS heads of width --hidden,
# and these sizes; batches of DECODER_BATCH sequences of DECODER_SEQUENCE tokens.
HF_KV_HEADS = 2
HF_INTERMEDIATE_PER_HIDDEN = 2
HF_VOCAB = 256

RUN_ROWS: tuple[Row | None, ...] = (
    *FIGURE_ROWS,
    None,
    Row("build_seconds", "graph building per step", SECONDS),
    Row("scan_traces", "torch_xla_ext scan traces", COUNT),
    Row("scan_stand_ins", "torch_xla_ext scan stand-ins", COUNT),
    Row("hlo_parameters", "HLO parameters of the step", COUNT),
    Row("peak_rss", "peak RSS", BYTES),
)
# Figures summed over the steps; the others are described in `summarize`.
SUMMED_KEYS = tuple(row.key for row in FIGURE_ROWS) + ("scan_traces", "scan_stand_ins")
# The sweep's two subplots.
PLOTTED_ROWS = (Row("compile_seconds", "XLA compile time (all steps)", SECONDS),
                Row("build_seconds", "graph building per step (steady state)", SECONDS))

WORKER_COMMAND = "_worker"

WORKLOAD_HELP = """\
workload contract:
  --workload MODULE:FUNCTION measures your own model instead of the decoder
  blocks. MODULE is imported (the current directory is on the import path),
  then, in each mode's process, FUNCTION(mode, layers, hidden) is called once,
  with mode 'loop', 'scan' or 'torch-xla-scan' (scan-device-data calls it with
  'scan'), to build the model and data on the XLA device. It returns a
  function step() that builds one training step without syncing and returns
  the step's outputs: the loss (a scalar) first, then the tensors the step
  updates, as a list or tuple of XLA tensors. step() is timed, then the script
  runs torch_xla.sync().

figures:
  Transfers, compilations, executions, scan traces and the stand-ins scan
  traces with are summed over the steps (what the set-up moves is left out);
  graph building is the mean time step() takes over the steps after the
  first; HLO parameters are those of the last step's graph (the outputs
  step() returns); peak RSS is the mode's process's.
  --json FILE writes every figure per mode, with a list of per-step figures.
  --op-times records two more steps per mode under torch_xla's profiler (on
  PJRT CPU) and prints, per kind of op, how many ran per step and their share
  of the time any op ran.

transformers models:
  --hf CONFIG measures a training step (forward with labels, the model's
  loss, backward, SGD) of a transformers model with random weights, built
  from CONFIG: a config.json file (or a directory holding one) of a causal
  language model, or one of the small built-in configs of the families
  {families}
  (width --hidden, {heads} heads, {kv_heads} key/value heads, intermediate
  {intermediate} x --hidden, vocabulary {vocab}). --layers overrides the
  config's depth (a config.json keeps its own without it). Batches of
  {batch} sequences of {sequence} tokens. The modes are:
{hf_modes}
  torch-xla-scan runs Llama models only; it is left out of the default modes
  for the others.

time limit:
  A mode's process that runs longer than --timeout seconds is stopped; the
  table shows it as timed out, the other modes run, and the exit code is 1.
  Modes run on the device PJRT_DEVICE names, CPU if it is not set.
""".format(
    families=", ".join(hf_workloads.FAMILIES), heads=DECODER_HEADS, kv_heads=HF_KV_HEADS,
    intermediate=HF_INTERMEDIATE_PER_HIDDEN, vocab=HF_VOCAB, batch=DECODER_BATCH,
    sequence=DECODER_SEQUENCE,
    hf_modes="\n".join(f"    {mode:<17} {description}" for mode, description in HF_MODES.items()))


def decoder_training(mode: str, layers: int, hidden: int):
    """The default workload: SGD training steps of `layers` decoder blocks of width `hidden`."""
    import torch
    import torch_xla
    from torch_xla_ext.workloads import make_batch, make_decoder_stack, training_step

    device = torch_xla.device()
    model = make_decoder_stack(layers, hidden, DECODER_HEADS, mode, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=DECODER_LEARNING_RATE)
    batch = make_batch(DECODER_BATCH, DECODER_SEQUENCE, hidden, device=device)

    def step():
        loss = training_step(model, batch, optimizer)
        return [loss, *model.parameters()]

    return step


def hf_config(spec: str, layers: int | None, hidden: int):
    """The transformers config `--hf spec` names (see WORKLOAD_HELP), `layers`
    deep if given, else as deep as the file says (DEFAULT_LAYERS for a family)."""
    if spec in hf_workloads.FAMILIES:
        return hf_workloads.family_config(spec, hf_workloads.ModelSizes(
            layers=layers or DEFAULT_LAYERS, hidden=hidden, heads=DECODER_HEADS,
            kv_heads=HF_KV_HEADS, intermediate=HF_INTERMEDIATE_PER_HIDDEN * hidden,
            vocab=HF_VOCAB, seq=DECODER_SEQUENCE))
    what = (f"--hf {spec!r}: expected the path of a config.json (or of a directory holding "
            f"one) or a built-in family: {', '.join(hf_workloads.FAMILIES)}")
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise InputError(f"{what}; there is no file {path}")
    try:
        with open(path, encoding="utf-8") as file:
            settings = json.load(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"{what}; {path} is not JSON: {error}") from None
    import transformers

    model_type = settings.get("model_type") if isinstance(settings, dict) else None
    if model_type not in transformers.CONFIG_MAPPING:
        raise InputError(f"{what}; {path} is not a transformers config: its model_type is "
                         f"{model_type!r}, which transformers does not know")
    config = transformers.AutoConfig.from_pretrained(path)
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise InputError(f"--hf {spec!r}: transformers has no causal language model of "
                         f"model_type {model_type!r}, and --hf trains one from a config.json")
    if layers is not None:
        config.num_hidden_layers = layers
    return config


def hf_family(spec: str) -> str | None:
    """The built-in family `--hf spec` names, None for a config.json."""
    return spec if spec in hf_workloads.FAMILIES else None


def hf_training(spec: str, mode: str, layers: int, hidden: int):
    """The --hf workload: SGD training steps of the transformers model of
    `hf_config(spec, layers, hidden)`, as `mode` runs it (HF_MODES)."""
    import torch
    import torch_xla
    from torch_xla_ext import stack_layers

    device = torch_xla.device()
    config = hf_config(spec, layers, hidden)
    family = hf_family(spec)
    model = hf_workloads.model_from_config(config, family)
    if mode == "scan":
        stack_layers(model)
    elif mode == "torch-xla-scan":
        model.model.layers = hf_workloads.torch_xla_scan_layers_wrapper(model.model.layers)
    model = model.to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=DECODER_LEARNING_RATE)
    inputs = hf_workloads.training_inputs(family, HF_VOCAB if family else config.vocab_size,
                                          DECODER_BATCH, DECODER_SEQUENCE, device)

    def step():
        optimizer.zero_grad()
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        return [loss, *model.parameters()]

    return step


def workload_name(args: argparse.Namespace) -> str:
    if args.hf is not None:
        return f"--hf {args.hf}"
    return args.workload or "decoder blocks"


def load_workload(args: argparse.Namespace):
    """The workload function `--workload MODULE:FUNCTION` or `--hf CONFIG`
    names, or the default one."""
    if args.hf is not None:
        return functools.partial(hf_training, args.hf)
    spec = args.workload
    if spec is None:
        return decoder_training
    module_name, colon, function_name = spec.partition(":")
    if not (colon and module_name and function_name):
        raise InputError(f"--workload {spec!r}: expected MODULE:FUNCTION, such as my_model:make_step")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise InputError(f"--workload {spec!r}: cannot import {module_name!r}: {error}") from None
    function = getattr(module, function_name, None)
    if function is None:
        raise InputError(f"--workload {spec!r}: module {module_name!r} ({module.__file__}) "
                         f"has no {function_name!r}")
    if not callable(function):
        raise InputError(f"--workload {spec!r}: {function_name!r} is a "
                         f"{type(function).__name__}, not a function")
    return function


def mode_list(text: str) -> list[str]:
    modes = [mode.strip() for mode in text.split(",")]
    for mode in modes:
        if mode not in MODES:
            raise argparse.ArgumentTypeError(
                f"unknown mode {mode!r} in {text!r}; choose from {', '.join(MODES)}")
        if modes.count(mode) > 1:
            raise argparse.ArgumentTypeError(f"mode {mode!r} is given twice in {text!r}")
    return modes


def step_count(text: str) -> int:
    steps = harness.positive_int(text)
    if steps < 2:
        # The first step compiles; per-step figures come from the steps after it.
        raise argparse.ArgumentTypeError(
            f"{text!r} is too few: the first step compiles, so at least 2 are needed")
    return steps


def layer_list(text: str) -> list[int]:
    depths = []
    for part in text.split(","):
        try:
            depth = harness.positive_int(part.strip())
        except argparse.ArgumentTypeError as error:
            raise argparse.ArgumentTypeError(f"in {text!r}: {error}") from None
        if depth in depths:
            raise argparse.ArgumentTypeError(f"{depth} layers is given twice in {text!r}")
        depths.append(depth)
    return depths


# ---------------------------------------------------------------- worker side


class StandInFactory:
    """Takes the place of `torch_xla_ext.scan.tracing.new_stand_in`, the one
    factory of every tensor scan traces or lowers with (its forward and
    backward steps' inputs, the captures it lifts, AOTAutograd's primals and
    cotangents), and counts the stand-ins made.

    With `from_host`, each stand-in is an uninitialized host tensor moved to
    the device: one host-to-device transfer per stand-in, which is what
    placeholders avoid. `torch.empty(..., device=xla)` would not do: torch_xla
    makes it a lazy broadcast of the constant 0, which moves nothing and would
    be baked into the trace as zeros. Otherwise the factory's own stand-ins
    (placeholders) are made.
    """

    def __init__(self, from_host: bool):
        import torch_xla

        self.made = 0
        self._device = torch_xla.device() if from_host else None
        self._original = importlib.import_module("torch_xla_ext.scan.tracing").new_stand_in
        # Modules that imported the factory by name hold it too (autograd.py does).
        for name, module in list(sys.modules.items()):
            if name == "torch_xla_ext" or name.startswith("torch_xla_ext."):
                for attribute, value in list(vars(module).items()):
                    if value is self._original:
                        setattr(module, attribute, self)

    def __call__(self, shape, dtype, requires_grad: bool = False, *, guarded: bool = True):
        import torch

        self.made += 1
        if self._device is None:
            return self._original(shape, dtype, requires_grad, guarded=guarded)
        return torch.empty(shape, dtype=dtype).to(self._device).requires_grad_(requires_grad)


def step_outputs(outputs, name: str) -> list:
    import torch

    outputs = [outputs] if isinstance(outputs, torch.Tensor) else outputs
    if (not isinstance(outputs, (list, tuple)) or not outputs
            or not all(isinstance(output, torch.Tensor) for output in outputs)):
        raise InputError(f"workload {name!r}: step() returned "
                         f"{type(outputs).__name__}; it must return a tensor or a non-empty "
                         "list or tuple of tensors, the loss first")
    return list(outputs)


def summarize(steps: list[dict]) -> dict:
    """A mode's figures from its per-step ones (see WORKLOAD_HELP)."""
    return {
        **{key: sum(step[key] for step in steps) for key in SUMMED_KEYS},
        "build_seconds": statistics.mean(step["build_seconds"] for step in steps[1:]),
        "hlo_parameters": steps[-1]["hlo_parameters"],
    }


def run_worker(args: argparse.Namespace) -> None:
    """Runs one mode and reports its figures to the parent (harness.report_result)."""
    import torch_xla
    import torch_xla_ext
    from torch_xla_ext.metrics import collect

    build_workload = load_workload(args)
    device_data = args.mode == "scan-device-data"
    stand_ins = StandInFactory(from_host=device_data)
    step = build_workload(WORKLOAD_MODES[args.mode], args.layers, args.hidden)
    torch_xla.sync()
    previous = collect()
    steps = []
    for _ in range(args.steps):
        if device_data:
            # Stand-ins are made, and moved, when scan traces; a cached trace
            # would move them once. torch_xla's scan_layers traces again at
            # every call (unless told its layers are pure), so this does too.
            torch_xla_ext.cache_clear()
        traces_before, stand_ins_before = torch_xla_ext.cache_info().misses, stand_ins.made
        started = time.perf_counter()
        outputs = step_outputs(step(), workload_name(args))
        build_seconds = time.perf_counter() - started
        scan_traces = torch_xla_ext.cache_info().misses - traces_before
        scan_stand_ins = stand_ins.made - stand_ins_before
        hlo_parameters = hlo_parameter_count(torch_xla._XLAC._get_xla_tensors_hlo(outputs))
        torch_xla.sync()
        current = collect()
        steps.append({**{key: current[key] - previous[key] for key in current},
                      "build_seconds": build_seconds, "scan_traces": scan_traces,
                      "scan_stand_ins": scan_stand_ins, "hlo_parameters": hlo_parameters})
        previous = current
    if device_data and not any(step["scan_traces"] for step in steps):
        raise InputError(f"workload {workload_name(args)!r} never called "
                         "torch_xla_ext.scan in mode 'scan', so scan-device-data has nothing "
                         "to trace with device data")
    # Read after the last figures were taken: it is a device-to-host transfer.
    final_loss = outputs[0].item()
    op_times = (harness.op_time_figures(lambda: step_outputs(step(), workload_name(args)))
                if args.op_times else None)
    harness.report_result({**summarize(steps), "peak_rss": peak_rss_bytes(),
                           "final_loss": final_loss, "steps": steps, "op_times": op_times})


# ---------------------------------------------------------------- parent side


def run_in_worker(mode: str, layers: int, args: argparse.Namespace) -> harness.Outcome:
    """One mode's figures, measured in a fresh process within the time limit."""
    arguments = [WORKER_COMMAND, "--mode", mode, "--layers", str(layers),
                 "--hidden", str(args.hidden), "--steps", str(args.steps)]
    if args.workload is not None:
        arguments += ["--workload", args.workload]
    if args.hf is not None:
        arguments += ["--hf", args.hf]
    if args.op_times:
        arguments.append("--op-times")
    return harness.run_worker(os.path.abspath(__file__), arguments, args.timeout)


def check_output_path(path: str | None, option: str) -> None:
    """Fails before the runs, not after them, on a file that cannot be written."""
    if path is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise InputError(f"{option} {path}: directory {directory} does not exist")


def check_plot_format(path: str) -> None:
    from matplotlib.figure import Figure

    extension = os.path.splitext(path)[1].lstrip(".").lower()
    supported = Figure().canvas.get_supported_filetypes()
    if extension not in supported:
        raise InputError(f"--plot {path}: matplotlib cannot write {extension or 'extension-less'} "
                         f"files; use one of .{', .'.join(sorted(supported))}")


def plot_sweep(path: str, depths: list[int], runs: list[dict], modes: list[str]) -> dict:
    """Draws PLOTTED_ROWS against depth, a line per mode through the depths it
    has figures for; returns what was drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(PLOTTED_ROWS), figsize=(11, 4.5))
    for axis, row in zip(axes, PLOTTED_ROWS):
        for mode in modes:
            points = [(layers, run[mode][row.key]) for layers, run in zip(depths, runs)
                      if row.key in run[mode]]
            if points:
                axis.plot(*zip(*points), marker="o", label=mode)
        axis.set(title=row.label, xlabel="layers", ylabel="seconds", xticks=depths)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    # Read back from the figure, so that the JSON holds what the plot shows.
    return {axis.get_title(): {line.get_label(): {"layers": [int(x) for x in line.get_xdata()],
                                                  "seconds": [float(y) for y in line.get_ydata()]}
                               for line in axis.get_lines()}
            for axis in axes}


def settle_workload(args: argparse.Namespace) -> tuple[str, str]:
    """Fills in the --layers, --hidden and --modes left out, checks those given
    against --hf's model (a bad --hf fails here, before any process starts),
    and returns the workload's title and the legend of its modes."""
    if args.hf is None:
        args.layers = args.layers or DEFAULT_LAYERS
        args.hidden = args.hidden or DEFAULT_HIDDEN
        args.modes = args.modes or list(MODES)
        return workload_name(args), ""
    family = hf_family(args.hf)
    if family is None and args.hidden is not None:
        raise InputError(f"--hidden {args.hidden}: --hf {args.hf!r} is a config.json, whose "
                         "hidden_size is the width; change it there, or leave --hidden out")
    hidden = args.hidden or DEFAULT_HIDDEN
    if family is not None and hidden % DECODER_HEADS:
        raise InputError(f"--hidden {hidden}: the built-in configs have {DECODER_HEADS} heads; "
                         f"give a multiple of {DECODER_HEADS}")
    config = hf_config(args.hf, args.layers, hidden)
    args.layers = args.layers or config.num_hidden_layers
    args.hidden = config.hidden_size
    unsupported = hf_workloads.torch_xla_scan_unsupported(config.model_type)
    if args.modes is None:
        args.modes = list(MODES)
        if unsupported:
            args.modes.remove("torch-xla-scan")
            print(f"not running torch-xla-scan: {unsupported}", file=sys.stderr, flush=True)
    elif unsupported and "torch-xla-scan" in args.modes:
        raise InputError(f"--modes torch-xla-scan: {unsupported}")
    source = "built-in config" if family else os.path.abspath(
        os.path.join(args.hf, "config.json") if os.path.isdir(args.hf) else args.hf)
    legend = "".join(f"\n  {mode}: {HF_MODES[mode]}" for mode in args.modes)
    return f"transformers {config.model_type} ({source})", legend


def run_run(args: argparse.Namespace) -> None:
    if args.plot is not None and args.sweep_layers is None:
        raise InputError("--plot draws a sweep over depths: give --sweep-layers too, "
                         "such as --sweep-layers 4,8,16,32")
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    if args.plot is not None:
        check_plot_format(args.plot)
    load_workload(args)  # a bad --workload fails here, before any process starts
    title, legend = settle_workload(args)
    depths = args.sweep_layers or [args.layers]
    baseline = BASELINE_MODE if BASELINE_MODE in args.modes else args.modes[0]
    run_count = len(depths) * len(args.modes)
    runs, every_outcome = [], {}
    for depth_index, layers in enumerate(depths):
        outcomes = {}
        for mode_index, mode in enumerate(args.modes):
            position = depth_index * len(args.modes) + mode_index + 1
            what = f"{mode}, {layers} layers" if args.sweep_layers else mode
            print(f"[{position}/{run_count}] {what}: running {args.steps} steps ...",
                  file=sys.stderr, flush=True)
            outcome = outcomes[mode] = every_outcome[what] = run_in_worker(mode, layers, args)
            if not outcome.ok:
                print(outcome.failure_report(f"mode {mode!r} with {layers} layers"),
                      file=sys.stderr, flush=True)
        runs.append(harness.outcome_columns(outcomes))
        if depth_index:
            print()
        print(f"{title}: {layers} layers, hidden {args.hidden}, {args.steps} steps{legend}")
        print(harness.outcome_table(outcomes, RUN_ROWS, baseline, args.markdown), flush=True)
        if args.op_times:
            print(f"\nWhere a step's time went, op by op (count and wall ms of each kind of op, "
                  f"per step, over {harness.OP_TIMES_EXECUTIONS} more steps):")
            harness.print_op_times({(mode, layers): outcome.figures
                                    for mode, outcome in outcomes.items() if outcome.ok},
                                   args.markdown)

    settings = {"workload": title, "hidden": args.hidden,
                "steps": args.steps, "modes": args.modes}
    if args.sweep_layers is None:
        output = {"settings": {**settings, "layers": args.layers}, "modes": runs[0]}
    else:
        output = {"settings": {**settings, "sweep_layers": depths},
                  "sweep": [{"layers": layers, "modes": results}
                            for layers, results in zip(depths, runs)]}
        if args.plot is not None:
            output["plot"] = plot_sweep(args.plot, depths, runs, args.modes)
    if args.json is not None:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(output, file, indent=1)
            file.write("\n")
    failures = harness.failure_summary(every_outcome)
    if failures:
        raise RunError(failures)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compare_metrics.py",
        description="Compare torch_xla metrics side by side: of a workload run in "
                    "several modes (run, the default command), or of two saved "
                    "metrics reports (diff).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # Options the run command passes on to its workers.
    workload_options = argparse.ArgumentParser(add_help=False)
    workload_options.add_argument(
        "--hidden", type=harness.positive_int,
        help=f"width of the layers (default {DEFAULT_HIDDEN}; a multiple of "
             f"{DECODER_HEADS} for the decoder blocks' and --hf families' {DECODER_HEADS} "
             "heads; not with --hf config.json, which sets its own)")
    workload_options.add_argument(
        "--steps", type=step_count, default=DEFAULT_STEPS,
        help=f"training steps per mode, 2 or more (default {DEFAULT_STEPS})")
    harness.add_op_times_option(workload_options, "steps")
    model = workload_options.add_mutually_exclusive_group()
    model.add_argument(
        "--workload", metavar="MODULE:FUNCTION",
        help="your own model instead of the decoder blocks (see the contract below)")
    model.add_argument(
        "--hf", metavar="CONFIG",
        help="a transformers model instead of the decoder blocks: a config.json, or a "
             f"family with a small built-in config ({', '.join(hf_workloads.FAMILIES)}); "
             "see below")

    mode_lines = "\n".join(f"  {mode:<17} {description}" for mode, description in MODES.items())
    run = commands.add_parser(
        "run", parents=[workload_options], formatter_class=argparse.RawDescriptionHelpFormatter,
        help="run a workload once per mode and compare their metrics (the default)",
        description="Run a training workload once per mode, each in a fresh process,\n"
                    "and print its torch_xla figures side by side, marking those that\n"
                    f"differ from {BASELINE_MODE} by more than 10%.\n\nmodes:\n{mode_lines}",
        epilog=WORKLOAD_HELP)
    depth = run.add_mutually_exclusive_group()
    depth.add_argument("--layers", type=harness.positive_int,
                       help=f"number of layers (default {DEFAULT_LAYERS}; with --hf "
                            "config.json, the file's)")
    depth.add_argument("--sweep-layers", type=layer_list, metavar="N,N,...",
                       help="run every mode at each of these depths, a table per depth")
    run.add_argument("--modes", type=mode_list, metavar="MODE,...",
                     help=f"modes to run, comma-separated (default {','.join(MODES)}; "
                          "with --hf, torch-xla-scan only for Llama models)")
    run.add_argument("--json", metavar="FILE",
                     help="also write the figures, per mode and per step, to FILE")
    run.add_argument("--plot", metavar="FILE.png",
                     help="with --sweep-layers, plot compile time and graph-building time "
                          "against depth, a line per mode (the plotted series go into --json)")
    harness.add_timeout_option(run, DEFAULT_TIMEOUT, "mode")
    harness.add_markdown_option(run)
    run.set_defaults(handler=run_run)

    diff = commands.add_parser(
        "diff", help="compare two saved metrics_report() texts",
        description="Print the figures of two saved metrics_report() texts side by side, "
                    "marking values of B that differ from A by more than 10%.")
    diff.add_argument("baseline_report", metavar="A", help="the report to compare against")
    diff.add_argument("other_report", metavar="B", help="the report to compare")
    diff.set_defaults(handler=run_diff)

    # One mode in this process, for run; not listed in the help.
    worker = commands.add_parser(WORKER_COMMAND, parents=[workload_options])
    worker.add_argument("--mode", choices=MODES, required=True)
    worker.add_argument("--layers", type=harness.positive_int, required=True)
    worker.set_defaults(handler=run_worker)
    return parser


def with_default_command(argv: list[str]) -> list[str]:
    """Puts `run` in front of arguments that start with no command."""
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        return ["run", *argv]
    return argv


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(with_default_command(sys.argv[1:] if argv is None else argv))
    try:
        args.handler(args)
    except InputError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    except RunError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
