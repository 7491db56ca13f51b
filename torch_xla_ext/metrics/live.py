"""The figures of the running process, read from torch_xla's own metrics and
profiler."""
from __future__ import annotations

import dataclasses
import tempfile
from typing import Any, Callable

import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as xla_metrics

from torch_xla_ext.metrics.op_times import OpTimes, check_executions, op_times, read_trace_events
from torch_xla_ext.metrics.report import SECONDS, MetricsReport, figures, parse_report


def live_report() -> MetricsReport:
    """The current process's metrics, after its pending device work finished."""
    # Executions are recorded when they complete, which is asynchronous.
    xm.wait_device_ops()
    # Parsing the report gives live and saved reports one code path, and the
    # metrics their units. The text rounds sizes to two decimals of their unit
    # (1.05MB), too coarse to subtract two reports, so the totals are then
    # replaced by torch_xla's own, which are exact.
    report = parse_report(xla_metrics.metrics_report())
    exact = {}
    for name, metric in report.metrics.items():
        total_samples, accumulator, _ = xla_metrics.metric_data(name)
        if metric.unit == SECONDS:
            accumulator /= 1e9  # torch_xla keeps nanoseconds
        exact[name] = dataclasses.replace(metric, total_samples=total_samples,
                                          accumulator=accumulator)
    return dataclasses.replace(report, metrics=exact)


def collect() -> dict[str, int | float]:
    """The headline figures (FIGURE_ROWS) of the current process."""
    return figures(live_report())


def measure_op_times(run: Callable[[], Any], executions: int = 1) -> OpTimes:
    """Calls `run` `executions` times under torch_xla's profiler, each call
    followed by a sync (which computes what `run` returns, and the tensors it
    updates) and a wait for the device, and returns where the executions'
    time went, op by op, per execution (see `metrics.op_times`).

    `run` builds the graph to measure (compile it beforehand: a compilation
    in the trace is not an op, but it delays them). Op spans are those of
    XLA:CPU's runtime, PJRT's CPU device."""
    import torch_xla
    import torch_xla.debug.profiler as profiler

    if not callable(run):
        raise TypeError(f"measure_op_times: run must be a function that builds the graph to "
                        f"measure, got {type(run).__name__} {run!r}")
    check_executions(executions)
    xm.wait_device_ops()
    with tempfile.TemporaryDirectory(prefix="op_times_") as directory:
        profiler.start_trace(directory)
        try:
            for _ in range(executions):
                held = run()  # torch_xla computes only the tensors held at the sync
                torch_xla.sync()
                xm.wait_device_ops()
                del held
        finally:
            profiler.stop_trace()
        return op_times(read_trace_events(directory), executions)
