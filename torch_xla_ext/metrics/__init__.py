"""torch_xla metrics as comparable figures.

- `report`: reading saved `metrics_report()` texts (`parse_report`) and their
  headline `figures`; needs neither torch nor torch_xla, so that reports saved
  elsewhere (a TPU host) can be compared anywhere;
- `live`: the same figures of the running process (`live_report`, `collect`),
  read from torch_xla; imported at their first use;
- `table`: `format_table`, figures side by side with the changes marked;
- `op_times`: where an execution's time went, op by op, read from a profiler
  trace (`op_times`); `measure_op_times` (in `live`) records one;
- `memory`: the process's peak RSS; `hlo`: the parameters of an HLO module,
  and, in XLA's optimized HLO dump, what one device holds and which
  collectives it runs.
"""
import importlib

from torch_xla_ext.metrics.hlo import hlo_parameter_count
from torch_xla_ext.metrics.memory import peak_rss_bytes, reset_peak_rss
from torch_xla_ext.metrics.op_times import (
    OpKind, OpTimes, OpTimesError, op_kind, op_times, read_trace_events)
from torch_xla_ext.metrics.report import (
    BYTES, COUNT, FIGURE_ROWS, SECONDS, Metric, MetricsReport, MetricsReportError, Row, figures,
    parse_bytes, parse_duration, parse_report, raw_figures, raw_rows)
from torch_xla_ext.metrics.table import format_table, format_value

# Only these import torch_xla.
_LIVE_NAMES = ("collect", "live_report", "measure_op_times")

__all__ = [
    "BYTES", "COUNT", "FIGURE_ROWS", "Metric", "MetricsReport", "MetricsReportError", "OpKind",
    "OpTimes", "OpTimesError", "Row", "SECONDS", "collect", "figures", "format_table",
    "format_value", "hlo_parameter_count", "live_report", "measure_op_times", "op_kind",
    "op_times", "parse_bytes", "parse_duration", "parse_report", "peak_rss_bytes",
    "raw_figures", "raw_rows", "read_trace_events", "reset_peak_rss",
]


def __getattr__(name: str):
    if name in _LIVE_NAMES:
        return getattr(importlib.import_module(f"{__name__}.live"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
