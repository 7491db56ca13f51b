"""Python time of cached scan calls: against the equivalent for loop, and with a
lambda made afresh at every call against a module-level function.

On PJRT's CPU backend unless PJRT_DEVICE names another device. Each
measurement builds the forward and backward graph (no execution is timed),
after warm-up calls that fill the caches; the two runs of a pair alternate,
so drift affects both alike. Times are CPU time of the calling thread, which
builds the graphs, so that other processes sharing the machine do not blur
them. Prints medians and their ratios.

1. scan against the for loop: `--iterations` steps of a `--width`-wide MLP block.
2. the per-call lambda: an RNN module whose forward calls
   `scan(lambda c, x: (torch.tanh(self.cell(c) + x), c.sum()), h, xs)`, so the
   lambda is new at each call, against the same scan given a module-level
   function; `--repeats` training steps each, and one trace in all.

    .venv/bin/python scripts/bench_scan.py [--iterations 32] [--width 256] [--repeats 20]
"""
import statistics
import time

import harness  # first: it sets the default device before torch_xla is imported
import torch
import torch_xla

import torch_xla_ext as tx
from torch_xla_ext.metrics.table import render_rows


def graph_building_seconds(run, tensors) -> float:
    """CPU seconds `run` takes to build its graphs; then runs them, untimed, to
    the end (so that the next measured run does not wait for them) and drops
    the gradients of `tensors`, so that graphs do not pile up."""
    start = time.thread_time()
    run()
    elapsed = time.thread_time() - start
    torch_xla.sync(wait=True)
    for tensor in tensors:
        tensor.grad = None
    return elapsed


def median_ms(runs, tensors, repeats: int) -> list[float]:
    """Per run, the median over `repeats` alternating measurements, in ms."""
    for run in runs:  # warm-up: trace, lower and compile once
        graph_building_seconds(run, tensors)
    times = [[] for _ in runs]
    for _ in range(repeats):
        for run, measured in zip(runs, times):
            measured.append(graph_building_seconds(run, tensors))
    return [statistics.median(measured) * 1e3 for measured in times]


def print_times(times: list[tuple[str, float]], goal: harness.Goal, markdown: bool) -> None:
    """A table of the runs' median graph-building times, then their ratio
    against its goal (a blank line apart, so that markdown keeps two tables)."""
    print(render_rows([["run", "median ms"], None,
                       *([name, f"{ms:.2f}"] for name, ms in times)], markdown))
    print()
    print(harness.goal_table([goal], markdown))


def scan_against_loop(args, device):
    block = torch.nn.Sequential(torch.nn.Linear(args.width, 4 * args.width), torch.nn.GELU(),
                                torch.nn.Linear(4 * args.width, args.width)).to(device)
    init = torch.randn(8, args.width, device=device, requires_grad=True)
    xs = torch.randn(args.iterations, 8, args.width, device=device, requires_grad=True)
    torch_xla.sync()

    def step(carry, x):
        return block(carry) + x, None

    def with_scan():
        carry, _ = tx.scan(step, init, xs)
        carry.sum().backward()

    def with_loop():
        carry = init
        for x in xs:
            carry, _ = step(carry, x)
        carry.sum().backward()

    scan_ms, loop_ms = median_ms([with_scan, with_loop], (init, xs, *block.parameters()),
                                 args.repeats)
    print(f"{args.iterations} iterations of a {args.width}-wide MLP block, forward + backward, "
          f"median of {args.repeats}")
    print_times([("for loop graph building", loop_ms), ("cached scan call", scan_ms)],
                harness.Goal("scan / loop", scan_ms / loop_ms, 0.2), args.markdown)


class RNN(torch.nn.Module):
    """A tanh RNN over `cell`: its forward passes scan either the issue's
    pattern, a lambda made afresh at every call, or a module-level function."""

    def __init__(self, cell: torch.nn.Linear, fresh_lambda: bool):
        super().__init__()
        self.cell = cell
        self.fresh_lambda = fresh_lambda

    def forward(self, h, xs):
        if self.fresh_lambda:
            return tx.scan(lambda c, x: (torch.tanh(self.cell(c) + x), c.sum()), h, xs)
        return tx.scan(module_level_step, h, xs)


# The cell the module-level function reads, set by the benchmark.
_cell: torch.nn.Linear | None = None


def module_level_step(c, x):
    return torch.tanh(_cell(c) + x), c.sum()


def per_call_lambda_against_function(args, device):
    global _cell
    _cell = torch.nn.Linear(args.width, args.width).to(device)
    h = torch.randn(8, args.width, device=device, requires_grad=True)
    xs = torch.randn(args.iterations, 8, args.width, device=device)
    torch_xla.sync()

    def training_step(model):
        def run():
            carry, ys = model(h, xs)
            (carry.pow(2).mean() + ys.mean()).backward()
        return run

    tx.cache_clear()
    lambda_ms, function_ms = median_ms(
        [training_step(RNN(_cell, fresh_lambda=True)), training_step(RNN(_cell, False))],
        (h, *_cell.parameters()), args.repeats)
    traces = tx.cache_info().misses
    print(f"\n{args.iterations} steps of a {args.width}-wide tanh RNN cell, forward + backward, "
          f"median of {args.repeats} training steps")
    print_times([("module-level function", function_ms), ("fresh lambda per call", lambda_ms)],
                harness.Goal("lambda / function", lambda_ms / function_ms, 1.2),
                args.markdown)
    print(f"\ntraces: {traces} (goal 2: one shared by the lambda's {args.repeats + 1} calls, one "
          f"for the function's)")


def main():
    parser = harness.benchmark_parser(__file__, __doc__)
    parser.add_argument("--iterations", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch_xla.device()
    torch.manual_seed(0)
    scan_against_loop(args, device)
    per_call_lambda_against_function(args, device)
    print(f"scan cache: {tx.cache_info()}")


if __name__ == "__main__":
    main()
