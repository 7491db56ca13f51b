"""What reading each layer's weights out of a stack costs, on the device at hand.

A scan over layers reads layer i's weights as slice i of stacked `[L, ...]`
weights; a for loop reads L separate tensors. XLA:CPU copies such a slice out
of the stack before a matrix product of several rows reads it (for one row, it
fuses the slice into the product), for dynamic and static slices alike, so a
pass over the layers writes and reads all the weights once more than the loop.
This script measures that cost alone, away from any model: L layers of
`h = h + tanh(linear(h, w_i))` on `--rows` rows (1 row is a decoding step at
batch 1, 8 one at batch 8, hundreds a prefill), no gradients,

* loop:        L separate `[hidden, hidden]` weights, an unrolled for loop;
* scan:        `torch_xla_ext.scan` over the same weights stacked, one While loop;
* scan unroll: the same scan with `unroll=True` (static slices, no loop),

each the median wall time of `--repeats` executions (the lazy graph is built
before the timer starts; the modes alternate, so drift affects all alike), after
warm-up runs that compile. It prints each mode's time and its ratio to the loop's,
and how far the scans' results are from the loop's.

    .venv/bin/python scripts/bench_slices.py [--layers 16] [--hidden 1024] [--rows 1,8,384]
"""
import statistics
import time

import harness  # first: it sets the default device before torch_xla is imported
import torch
import torch_xla
import torch_xla.core.xla_model as xm

import torch_xla_ext as tx
from torch_xla_ext.metrics.table import render_rows


def layer(h, w):
    return h + torch.tanh(torch.nn.functional.linear(h, w))


def passes(stacked, separate, rows: int, device):
    """Each mode as a function building its lazy graph for `rows` rows."""
    h0 = torch.randn(rows, stacked.shape[-1], device=device) * 0.1
    torch_xla.sync(wait=True)

    def loop():
        h = h0
        for w in separate:
            h = layer(h, w)
        return h

    def scanned(unroll):
        def run():
            return tx.scan(lambda h, w: (layer(h, w), None), h0, stacked, unroll=unroll)[0]
        return run

    return {"loop": loop, "scan": scanned(1), "scan unroll": scanned(True)}


def executed_ms(build) -> float:
    """Wall time of executing the graph `build` makes, built untimed first."""
    result = build()
    start = time.perf_counter()
    torch_xla.sync()
    xm.wait_device_ops()
    elapsed = time.perf_counter() - start
    del result
    return elapsed * 1e3


def median_times(modes: dict, repeats: int) -> dict:
    for build in modes.values():  # warm-up: compiles each graph
        executed_ms(build)
        executed_ms(build)
    times = {name: [] for name in modes}
    for _ in range(repeats):
        for name, build in modes.items():
            times[name].append(executed_ms(build))
    return {name: statistics.median(values) for name, values in times.items()}


def largest_difference(modes: dict) -> float:
    """The largest absolute difference of the scans' results from the loop's."""
    results = {name: build().cpu() for name, build in modes.items()}
    return max((results[name] - results["loop"]).abs().max().item() for name in results)


def main(argv=None):
    parser = harness.benchmark_parser(__file__, __doc__)
    parser.add_argument("--layers", type=harness.positive_int, default=16)
    parser.add_argument("--hidden", type=harness.positive_int, default=1024)
    parser.add_argument("--rows", type=harness.positive_ints, default=[1, 8, 384],
                        help="comma-separated numbers of rows, one measurement each")
    parser.add_argument("--repeats", type=harness.positive_int, default=15)
    args = parser.parse_args(argv)
    device = torch_xla.device()
    torch.manual_seed(0)
    stacked = torch.randn(args.layers, args.hidden, args.hidden, device=device) / args.hidden**0.5
    separate = [w.clone() for w in stacked]
    torch_xla.sync(wait=True)
    weights_mib = stacked.numel() * stacked.element_size() / 2**20
    print(f"{harness.device_name()}: {args.layers} layers of h + tanh(linear(h, w)), w "
          f"[{args.hidden}, {args.hidden}] f32 ({weights_mib:.0f} MiB of weights in all); "
          f"median of {args.repeats} executions")
    rows = [["rows", "loop ms", "scan ms", "scan unroll ms", "scan / loop",
             "scan unroll / loop", "max abs diff"], None]
    for count in args.rows:
        modes = passes(stacked, separate, count, device)
        ms = median_times(modes, args.repeats)
        rows.append([str(count), f"{ms['loop']:.2f}", f"{ms['scan']:.2f}",
                     f"{ms['scan unroll']:.2f}", f"{ms['scan'] / ms['loop']:.3f}",
                     f"{ms['scan unroll'] / ms['loop']:.3f}",
                     f"{largest_difference(modes):.1e}"])
    print(render_rows(rows, args.markdown))


if __name__ == "__main__":
    main()
