"""The figures of the running process, read from torch_xla's own metrics."""
from __future__ import annotations

import dataclasses

import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as xla_metrics

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
