#!/usr/bin/env python
"""torch's scan operator on XLA through each path, unregistered and registered:
how many While loops each runs, and how far its results are from a Python for
loop's.

The function is a recurrence over `--steps` stacked [8, 8] weights with a bias
captured from the enclosing scope, `c <- tanh(c @ w + b)`, its output `2c` at
each step, from an `init` that does not require grad (the case torch 2.9's own
backward gets wrong). Each path runs it, unregistered then within
`register_torch_scan()`, in this process:

* eager forward:    torch's `scan()` under `torch.no_grad()`;
* eager training:   forward and backward (gradients of `carry.sum() + ys.sum()`
                    for the weights and the bias);
* autocast:         eager training under `torch.autocast("xla", bfloat16)`
                    (its difference from the loop under the same autocast);
* export+StableHLO: `torch.export` of a module calling it, lowered by
                    `exported_program_to_stablehlo` (forward; `stablehlo.while`);
* openxla_scan:     3 training steps of `torch.compile(backend=openxla_scan)`
                    (the loops counted in XLA's optimized HLO of the compiled
                    graphs; compilations per step; this path needs no
                    registration, so both columns are one run).

Loops are counted in the HLO of the results (eager), in the StableHLO text
(export), or in XLA's dumps (compile); the difference is the largest absolute
difference of the results and gradients from the loop's, run on the device.

    .venv/bin/python scripts/torch_scan_paths.py [--steps 6] [--markdown]
"""
from __future__ import annotations

import glob
import os
import sys
import tempfile

import harness  # first: it sets the default device before torch_xla is imported

DUMPS = tempfile.mkdtemp(prefix="torch_scan_paths_")
# XLA reads its flags when torch_xla starts: the compiled graphs' HLO is dumped here.
os.environ["XLA_FLAGS"] = " ".join(filter(None, [
    os.environ.get("XLA_FLAGS"), f"--xla_dump_to={DUMPS}", "--xla_dump_hlo_as_text"]))

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
from torch._higher_order_ops.scan import scan as torch_scan  # noqa: E402

import torch_xla_ext as tx  # noqa: E402
from torch_xla_ext.metrics.table import render_rows  # noqa: E402

DEV = torch_xla.device()


class Recurrence(torch.nn.Module):
    def __init__(self, steps: int):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = torch.nn.Parameter(torch.randn(steps, 8, 8, generator=generator) * 0.4)
        self.bias = torch.nn.Parameter(torch.randn(8, generator=generator))

    def step(self, c, w):
        new = torch.tanh(c @ w + self.bias)
        return new, new * 2

    def forward(self, h, loop=False):
        if not loop:
            return torch_scan(self.step, h, self.weights)
        ys = []
        for w in self.weights:
            h, y = self.step(h, w)
            ys.append(y)
        return h, torch.stack(ys)


def largest_difference(got, expected) -> float:
    return max(float((g.detach().cpu().float() - e.detach().cpu().float()).abs().max())
               for g, e in zip(got, expected))


def loops_in(tensors) -> int:
    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors)).count(" while(")


def eager(model, h, grad: bool, autocast: bool):
    """(loops, results) of one path: the results and, with `grad`, the gradients."""
    outputs = {}
    for loop in (False, True):
        with torch.set_grad_enabled(grad), torch.autocast("xla", dtype=torch.bfloat16,
                                                          enabled=autocast):
            carry, ys = model(h, loop=loop)
        results = [carry, ys]
        if grad:
            results += torch.autograd.grad(carry.float().sum() + ys.float().sum(),
                                           [model.weights, model.bias])
        outputs[loop] = (loops_in(results), results)
    return outputs[False][0], largest_difference(outputs[False][1], outputs[True][1])


def exported(model, h):
    from torch_xla.stablehlo import exported_program_to_stablehlo
    # torch's scan() compiles itself with Dynamo, whose guards on the export's
    # shapes inductor would build in C++, after compiling programs to learn the
    # host's vector ISA (about 25 s once per process, no part of this path).
    with torch._dynamo.config.patch(enable_cpp_symbolic_shape_guards=False):
        program = torch.export.export(model.cpu(), (h.cpu(),))
    lowered = exported_program_to_stablehlo(program)
    expected = model(h.cpu(), loop=True)
    model.to(DEV)
    return (lowered.get_stablehlo_text().count("stablehlo.while"),
            largest_difference(lowered(h.cpu()), expected))


def compiled(model, h, steps=3):
    """openxla_scan: loops in the compiled graphs, the largest difference of
    losses and gradients over `steps` SGD steps, compilations per step."""
    reference = Recurrence(model.weights.shape[0]).to(DEV)
    model_compiled = torch.compile(model, backend=tx.openxla_scan)
    runs = {}
    for name, module, run in (("loop", reference, lambda m: m(h, loop=True)),
                              ("compiled", model, lambda m: model_compiled(h))):
        before = set(glob.glob(f"{DUMPS}/*after_optimizations.txt"))
        optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
        recorded, compilations = [], []
        for _ in range(steps):
            count = met.counter_value("UncachedCompile") or 0
            carry, ys = run(module)
            loss = carry.sum() + ys.sum()
            loss.backward()
            recorded += [loss.detach().clone(), module.weights.grad.clone(),
                         module.bias.grad.clone()]
            optimizer.step()
            optimizer.zero_grad()
            torch_xla.sync()
            compilations.append((met.counter_value("UncachedCompile") or 0) - count)
        new = set(glob.glob(f"{DUMPS}/*after_optimizations.txt")) - before
        runs[name] = (sum(open(path).read().count(" while(") for path in new), recorded,
                      compilations)
    loops, recorded, compilations = runs["compiled"]
    return loops, largest_difference(recorded, runs["loop"][1]), compilations


def main(argv=None) -> None:
    parser = harness.benchmark_parser(__file__, __doc__)
    parser.add_argument("--steps", type=harness.positive_int, default=6,
                        help="the scan's length (default 6)")
    args = parser.parse_args(argv)
    model = Recurrence(args.steps).to(DEV)
    h = torch.randn(2, 8, generator=torch.Generator().manual_seed(1)).to(DEV)
    paths = {"eager forward": lambda: eager(model, h, False, False),
             "eager training": lambda: eager(model, h, True, False),
             "autocast training": lambda: eager(model, h, True, True),
             "export+StableHLO": lambda: exported(model, h)}
    figures, failures = {}, []
    for registered in (False, True):
        with tx.register_torch_scan() if registered else torch.autograd.set_grad_enabled(True):
            for path, run in paths.items():
                try:
                    loops, difference = run()
                    figures[path, registered] = [str(loops), f"{difference:.2e}"]
                except Exception as error:  # a path that fails is a figure of the table
                    figures[path, registered] = ["fails", "-"]
                    failures.append(f"{path}, {('unregistered', 'registered')[registered]}: "
                                    f"{type(error).__name__}: {_first_line(error)}")
    loops, difference, compilations = compiled(model, h)
    figures["openxla_scan training", False] = figures["openxla_scan training", True] = [
        str(loops), f"{difference:.2e}"]
    print(f"{harness.device_name()}: c <- tanh(c @ w + b) over {args.steps} weights [8, 8]")
    rows = [["path", "loops unregistered", "loops registered", "max abs diff unregistered",
             "max abs diff registered"], None]
    for path in (*paths, "openxla_scan training"):
        unregistered, registered = figures[path, False], figures[path, True]
        rows.append([path, unregistered[0], registered[0], unregistered[1], registered[1]])
    print(render_rows(rows, markdown=args.markdown))
    print(f"openxla_scan: XLA compilations per step {compilations}")
    for failure in failures:
        print(f"fails: {failure}")


def _first_line(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0][:200] if lines else ""


if __name__ == "__main__":
    sys.exit(main())
