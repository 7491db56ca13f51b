"""The worker of scripts/sweep_causal_lm.py: one model type, trained
unconverted and converted by `stack_layers`, in this process.

`run_type(model_type, layers)` returns the figures the sweep classifies: an
error of the unconverted model (`base_error`), a refusal (`refused`), an
error of the converted training (`raised`), or the observations of both
trainings (warnings, scans, layer calls outside them, differences).
Of torch_xla_ext it uses the public API only (stack_layers, its warnings,
depends_on_placeholder); the rest it reads from the lazy graph's HLO, module calls
and state_dict.
"""
from __future__ import annotations

import contextlib
import copy
import re
import sys
import time
import traceback
import warnings

import torch

import sweep_configs

# The steps each model trains, and their learning rate: a first step's
# gradient is read back from the weights it changed, (before - after) / LR.
STEPS = 2
LR = 0.1
BATCH = 2
# Training results, compared by state_dict key: test/tolerances.py's TRAINING
# (float32 on XLA:CPU; a scan's graph fuses and orders the layers' operations
# differently from the for loop's, and each step starts from the last's rounding).
TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}

# An XLA While loop in HLO text, and the condition computation it names.
WHILE = re.compile(r"\bwhile\(.*?condition=%?([\w.\-]+)")
# Random number ops in HLO text.
RANDOM = re.compile(r"\b(rng|rng-bit-generator|rng-get-and-update-state)\(")
WARNING_CATEGORIES = ("LayerByLayerWarning", "UnstackedLayersWarning")
# Written to stderr as each part starts, so that the sweep knows which part a
# worker that died was in; the unconverted model's parts are BASE_PARTS.
PART_MARK = "sweep worker part: "
BASE_PARTS = ("build", "unconverted")


class BaseError(Exception):
    """The unconverted model failed to build or train: not the conversion's doing."""

    def __init__(self, stage: str, error: BaseException):
        super().__init__(f"{stage}: {type(error).__name__}: {error}")
        self.stage, self.error = stage, error


def describe(error: BaseException) -> str:
    """The error's type and message, and where it was raised."""
    frame = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = f" (at {frame[0].filename.split('site-packages/')[-1]}:{frame[0].lineno})" \
        if frame else ""
    return f"{type(error).__name__}: {error}{where}"


def forward_scans(hlo: str) -> list[dict]:
    """Each While loop of `hlo` (one per scan): the steps its condition compares with."""
    scans = []
    for match in WHILE.finditer(hlo):
        body = re.search(rf"^%?{re.escape(match.group(1))} .*?^}}", hlo, re.S | re.M)
        bound = re.findall(r"s64\[\] constant\((\d+)\)", body.group(0)) if body else []
        scans.append({"steps": int(bound[-1]) if bound else None})
    return scans


def cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's floating-point state_dict entries, on the CPU, in one transfer."""
    import torch_xla.core.xla_model as xm

    state = {key: value.detach() for key, value in model.state_dict().items()
             if value.is_floating_point()}
    return {key: value.clone() for key, value in xm._maybe_convert_to_cpu(state).items()}


class LayerCalls:
    """Counts the calls of the decoder layers (modules of `classes`) that run
    outside a traced scan: their output is device data, not traced on
    placeholders or fake tensors."""

    def __init__(self, classes: set[type]):
        self.classes, self.count, self.handle = classes, 0, None

    def __enter__(self):
        self.handle = torch.nn.modules.module.register_module_forward_hook(self.called)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def called(self, module, args, output):
        if type(module) not in self.classes:
            return
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._pytree import tree_leaves
        from torch_xla_ext import depends_on_placeholder

        tensors = [each for each in tree_leaves(output) if isinstance(each, torch.Tensor)]
        if tensors and (isinstance(tensors[0], FakeTensor) or depends_on_placeholder(tensors[0])):
            return
        self.count += 1


def layer_classes(model: torch.nn.Module) -> set[type]:
    """The classes of the model's layer lists' layers that it names in _no_split_modules."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return {type(layer) for module in model.modules() if isinstance(module, torch.nn.ModuleList)
            for layer in module if type(layer).__name__ in names}


def train(model, input_ids, classes: set[type], eval_mode: bool) -> dict:
    """STEPS SGD steps on XLA: losses, the first step's forward HLO, the
    weights after the first and the last step, the layer calls of the second."""
    import torch_xla

    device = torch_xla.device()
    model.to(device).train(not eval_mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ids = input_ids.to(device)
    losses, hlo, after_first, calls = [], "", {}, None
    for step in range(STEPS):
        counter = LayerCalls(classes)
        with counter if step == 1 else contextlib.nullcontext():
            loss = model(ids, labels=ids).loss
        if step == 0:
            hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch_xla.sync()
        losses.append(loss.item())
        if step == 0:
            after_first = cpu_state(model)
        else:
            calls = counter.count
    return {"losses": losses, "hlo": hlo, "after_first": after_first,
            "weights": cpu_state(model), "calls": calls}


def difference(actual: dict, expected: dict) -> dict:
    """The largest differences of `actual` from `expected` (tensors by key),
    and whether every entry is within TOLERANCE."""
    if actual.keys() != expected.keys():
        missing = sorted(expected.keys() - actual.keys())[:3]
        extra = sorted(actual.keys() - expected.keys())[:3]
        return {"ok": False, "max_abs": float("inf"), "max_rel": float("inf"),
                "worst": f"keys differ: missing {missing}, extra {extra}"}
    worst, max_abs, max_rel, ok = None, 0.0, 0.0, True
    for key in expected:
        a, e = actual[key].double(), expected[key].double()
        if a.shape != e.shape:
            return {"ok": False, "max_abs": float("inf"), "max_rel": float("inf"),
                    "worst": f"{key}: shape {list(a.shape)} != {list(e.shape)}"}
        if not a.numel():
            continue
        error = (a - e).abs().nan_to_num(nan=float("inf"))
        excess = (error - TOLERANCE["atol"] - TOLERANCE["rtol"] * e.abs()).max().item()
        if error.max().item() > max_abs:
            worst, max_abs = key, error.max().item()
        max_rel = max(max_rel, (error / e.abs().clamp_min(1e-12)).max().item())
        ok = ok and excess <= 0
    return {"ok": ok, "max_abs": max_abs, "max_rel": max_rel, "worst": worst}


def recorded(caught) -> list[dict]:
    """The conversion's warnings among `caught`, each message once."""
    found = {}
    for each in caught:
        category = each.category.__name__
        if category in WARNING_CATEGORIES:
            found.setdefault((category, str(each.message)), None)
    return [{"category": category, "message": message} for category, message in found]


def run_type(model_type: str, layers: int) -> dict:
    """The figures of `model_type` at `layers` layers (see the module's docstring)."""
    figures: dict = {"type": model_type, "layers": layers, "seconds": {}}
    started = time.perf_counter()

    def timed(part: str, following: str | None = None):
        nonlocal started
        now = time.perf_counter()
        figures["seconds"][part] = round(now - started, 2)
        started = now
        if following:
            mark(following)

    mark("build")
    try:
        pristine, input_ids, base, eval_mode = train_unconverted(model_type, layers, figures,
                                                                 timed)
    except BaseError as error:
        figures["base_error"] = {"stage": error.stage, "error": describe(error.error)}
        return figures
    classes = layer_classes(pristine)
    mark("convert")
    converted_model = copy.deepcopy(pristine)
    from torch_xla_ext import stack_layers

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            stack_layers(converted_model)
        except Exception as error:
            figures["refused"] = {"exception": type(error).__name__, "message": str(error)}
        timed("convert", "converted")
        figures["warnings"] = recorded(caught)
        if "refused" in figures:
            return figures
        try:
            converted = train(converted_model, input_ids, classes, eval_mode)
        except Exception as error:
            figures["raised"] = {"error": describe(error)}
        figures["warnings"] = recorded(caught)
    timed("converted")
    if "raised" in figures:
        return figures
    before = cpu_state(pristine)
    figures["scans"] = forward_scans(converted["hlo"])[len(forward_scans(base["hlo"])):]
    figures["calls_outside"] = converted["calls"]
    figures["losses"] = {"unconverted": base["losses"], "converted": converted["losses"]}
    figures["diffs"] = {
        "losses": difference({"loss": torch.tensor(converted["losses"])},
                             {"loss": torch.tensor(base["losses"])}),
        "grads": difference(first_gradients(before, converted["after_first"]),
                            first_gradients(before, base["after_first"])),
        "weights": difference(converted["weights"], base["weights"]),
    }
    timed("compare")
    return figures


def mark(part: str) -> None:
    print(PART_MARK + part, file=sys.stderr, flush=True)


def first_gradients(before: dict, after: dict) -> dict:
    """The first step's gradients, read back from the weights SGD changed."""
    return {key: (before[key] - after[key]) / LR for key in before if key in after}


def train_unconverted(model_type: str, layers: int, figures: dict, timed):
    """Builds the model (kept unmoved, for the converted side) and trains a copy
    of it unconverted, in eval mode if its training draws random numbers."""
    import transformers

    try:
        config, changes = sweep_configs.small_config(model_type, layers)
        figures["changes"] = changes
        torch.manual_seed(0)
        pristine = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", experts_implementation="batched_mm",
            dtype=torch.float32)
        vocab = pristine.get_output_embeddings().weight.shape[0]
        input_ids = torch.randint(0, sweep_configs.input_id_limit(vocab),
                                  (BATCH, sweep_configs.SEQUENCE))
    except Exception as error:
        raise BaseError("build", error) from error
    figures["parameters"] = sum(p.numel() for p in pristine.parameters())
    timed("build", "unconverted")
    classes = layer_classes(pristine)
    eval_mode = False
    try:
        base = train(copy.deepcopy(pristine), input_ids, classes, eval_mode)
        if RANDOM.search(base["hlo"]):
            eval_mode = True
            base = train(copy.deepcopy(pristine), input_ids, classes, eval_mode)
    except Exception as error:
        raise BaseError("train", error) from error
    if not all(torch.isfinite(torch.tensor(base["losses"]))):
        raise BaseError("train", ValueError(f"losses {base['losses']} are not finite"))
    figures["eval_mode"] = eval_mode
    figures["layer_calls"] = base["calls"]
    timed("unconverted")
    return pristine, input_ids, base, eval_mode
