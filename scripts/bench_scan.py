"""Python time of one cached scan call against the equivalent for loop.

PJRT CPU; 32 iterations of a 256-wide MLP block; each measurement builds the
forward and backward graph (no execution is timed), after warm-up calls that fill
the caches. Prints both medians and their ratio, measured side by side.

    .venv/bin/python scripts/bench_scan.py [--iterations 32] [--width 256] [--repeats 20]
"""
import argparse
import statistics
import time

import torch
import torch_xla

import torch_xla_ext as tx


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    device = torch_xla.device()
    torch.manual_seed(0)
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

    def graph_building_seconds(run):
        start = time.perf_counter()
        run()
        elapsed = time.perf_counter() - start
        torch_xla.sync()  # execute, untimed, so graphs do not pile up
        for tensor in (init, xs, *block.parameters()):
            tensor.grad = None
        return elapsed

    for run in (with_scan, with_loop):  # warm-up: trace, lower and compile once
        graph_building_seconds(run)
    scan_times, loop_times = [], []
    for _ in range(args.repeats):  # alternate, so drift affects both alike
        scan_times.append(graph_building_seconds(with_scan))
        loop_times.append(graph_building_seconds(with_loop))
    scan_ms, loop_ms = statistics.median(scan_times) * 1e3, statistics.median(loop_times) * 1e3
    print(f"{args.iterations} iterations of a {args.width}-wide MLP block, forward + backward, "
          f"median of {args.repeats}")
    print(f"  for loop graph building : {loop_ms:8.2f} ms")
    print(f"  cached scan call        : {scan_ms:8.2f} ms")
    print(f"  ratio scan / loop       : {scan_ms / loop_ms:8.3f}  (goal <= 0.2)")
    print(f"  scan cache: {tx.cache_info()}")


if __name__ == "__main__":
    main()
