"""Reading saved torch_xla metrics reports; no torch, no torch_xla needed.

`parse_report` reads the text of `torch_xla.debug.metrics.metrics_report()`
(saved to a file, or taken live by `live.live_report`), and `figures` reduces a
report to the headline numbers that matter when a loop and `scan` are compared
(transfers, bytes, compilations, executions). Values are normalized: durations
to seconds, sizes to bytes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

# Units of a row or a metric: what its values count.
COUNT = ""
SECONDS = "s"
BYTES = "B"


class MetricsReportError(ValueError):
    """A metrics report text that does not follow torch_xla's format."""

    def __init__(self, line_number: int, line: str, problem: str):
        self.line_number = line_number
        self.line = line
        self.problem = problem
        super().__init__(f"line {line_number}: {problem} (line: {line!r})")


@dataclass(frozen=True)
class Metric:
    """One `Metric:` block. Values are in `unit`: seconds, bytes or plain numbers."""
    name: str
    unit: str
    total_samples: int
    accumulator: float
    # Both rates are only printed when the kept samples span some time.
    value_rate: float | None
    samples_per_second: float | None
    percentiles: dict[float, float] = field(default_factory=dict)


@dataclass(frozen=True)
class MetricsReport:
    counters: dict[str, int]
    metrics: dict[str, Metric]

    # torch_xla leaves counters and metrics out of the report while they are
    # still zero, so a missing name means zero rather than unknown.
    def counter(self, name: str) -> int:
        return self.counters.get(name, 0)

    def sample_count(self, name: str) -> int:
        metric = self.metrics.get(name)
        return metric.total_samples if metric else 0

    def total(self, name: str) -> float:
        metric = self.metrics.get(name)
        return metric.accumulator if metric else 0.0


class Row(NamedTuple):
    """One line of a table: the figure's key in each column, its label, its unit."""
    key: str
    label: str
    unit: str


# ---------------------------------------------------------------- value formats

# torch_xla writes a duration as its non-zero leading parts followed by every
# smaller part down to microseconds, e.g. 02m03s004ms005.006us; other sources
# write 1.5ms or 12ns, which are accepted too.
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(d|h|ms|m|s|us|ns)")
_NANOSECONDS_PER_UNIT = {
    "d": 86400e9, "h": 3600e9, "m": 60e9, "s": 1e9, "ms": 1e6, "us": 1e3, "ns": 1.0,
}
_DURATION_UNITS = list(_NANOSECONDS_PER_UNIT)
_SIZE = re.compile(r"(\d+(?:\.\d+)?)(B|KB|MB|GB|TB|PB)")
_SIZE_UNITS = ["B", "KB", "MB", "GB", "TB", "PB"]  # powers of 1024
# torch_xla prints plain metric values with two decimals, so a bare integer is
# a value that lost its unit.
_PLAIN_NUMBER = re.compile(r"-?\d+\.\d+")
_FLOAT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_DURATION_EXAMPLE = "01s234ms567.890us, 1.5ms or 12ns"
_SIZE_EXAMPLE = "16.00B or 1.50KB"


def parse_duration(text: str) -> float:
    """Seconds in a torch_xla duration such as 01m02s003ms004.005us, 1.5ms or 12ns."""
    parts = []
    position = 0
    while position < len(text):
        part = _DURATION_PART.match(text, position)
        if part is None:
            raise ValueError(
                f"{text!r} is not a duration: expected parts like {_DURATION_EXAMPLE} "
                f"(units d, h, m, s, ms, us, ns), stopped at {text[position:]!r}")
        parts.append((part.group(2), part.group(1)))
        position = part.end()
    if not parts:
        raise ValueError(f"empty duration: expected one like {_DURATION_EXAMPLE}")
    unit_ranks = [_DURATION_UNITS.index(unit) for unit, _ in parts]
    if any(later <= earlier for earlier, later in zip(unit_ranks, unit_ranks[1:])):
        raise ValueError(
            f"{text!r} is not a duration: its units must go from largest to smallest, "
            f"each at most once, as in {_DURATION_EXAMPLE}")
    if _is_torch_xla_duration(parts):
        nanoseconds = _torch_xla_nanoseconds(parts)
    else:
        nanoseconds = sum(float(number) * _NANOSECONDS_PER_UNIT[unit] for unit, number in parts)
    return nanoseconds / 1e9


def _is_torch_xla_duration(parts: list[tuple[str, str]]) -> bool:
    units = [unit for unit, _ in parts]
    first = _DURATION_UNITS.index(units[0])
    whole_parts = [number for _, number in parts[:-1]]
    return (units == _DURATION_UNITS[first:_DURATION_UNITS.index("us") + 1]
            and all("." not in number for number in whole_parts))


def _torch_xla_nanoseconds(parts: list[tuple[str, str]]) -> float:
    # torch_xla rounds each whole part (d, h, m, s, ms) to the nearest integer
    # but then prints only what is left after truncating it, so a part reads one
    # too high whenever the smaller parts add up to half of its unit or more:
    # 3.6s is written 04s600ms000.000us. Undo that from the smallest part up.
    # (An exact half is ambiguous: C rounds it to the even neighbour.)
    *whole_parts, (_, microseconds) = parts
    nanoseconds = float(microseconds) * 1e3
    for unit, number in reversed(whole_parts):
        unit_nanoseconds = _NANOSECONDS_PER_UNIT[unit]
        whole = int(number)
        if nanoseconds >= unit_nanoseconds / 2:
            whole -= 1
        nanoseconds += whole * unit_nanoseconds
    return nanoseconds


def parse_bytes(text: str) -> float:
    """Bytes in a torch_xla size such as 16.00B or 1.50KB (K, M, G... are powers of 1024)."""
    size = _SIZE.fullmatch(text)
    if size is None:
        raise ValueError(f"{text!r} is not a size: expected one like {_SIZE_EXAMPLE}")
    number, unit = size.groups()
    return float(number) * 1024 ** _SIZE_UNITS.index(unit)


def _unit_of(text: str) -> str:
    """The unit of a metric, recognized from how its Accumulator is written."""
    if _PLAIN_NUMBER.fullmatch(text):
        return COUNT
    if _SIZE.fullmatch(text):
        return BYTES
    if _DURATION_PART.match(text):
        return SECONDS
    if re.fullmatch(r"-?\d+", text):
        raise ValueError(
            f"value {text!r} has no unit: expected a duration like {_DURATION_EXAMPLE}, "
            f"a size like {_SIZE_EXAMPLE} or a number with decimals like 4.00")
    raise ValueError(
        f"value {text!r} is neither a duration like {_DURATION_EXAMPLE}, a size like "
        f"{_SIZE_EXAMPLE} nor a number with decimals like 4.00")


# Per unit: the pattern a value must match, how it is read, an example and what
# the metric holds, for the message when it does not match.
_VALUE_FORMATS = {
    SECONDS: (_DURATION_PART.match, parse_duration,
              f"a duration like {_DURATION_EXAMPLE}", "durations"),
    BYTES: (_SIZE.fullmatch, parse_bytes, f"a size like {_SIZE_EXAMPLE}", "sizes"),
    COUNT: (_PLAIN_NUMBER.fullmatch, float, "a number with decimals like 4.00", "plain numbers"),
}


def _parse_value(text: str, unit: str, metric_name: str) -> float:
    matches, parse, expected, holds = _VALUE_FORMATS[unit]
    if not matches(text):
        raise ValueError(f"value {text!r} is not {expected}, but metric {metric_name!r} holds "
                         f"{holds} (see its Accumulator)")
    return parse(text)


# ---------------------------------------------------------------- report parser

_HEADER = re.compile(r"(Metric|Counter): (\S.*)")
_FIELD = re.compile(r"(\w+):(?: (.*))?")
_INTEGER = re.compile(r"-?\d+")


class _Lines:
    """The report's lines with their 1-based numbers, skipping blank lines."""

    def __init__(self, text: str):
        self._lines = [line.rstrip() for line in text.splitlines()]
        self._index = 0

    def next(self) -> tuple[int, str] | None:
        while self._index < len(self._lines):
            self._index += 1
            if self._lines[self._index - 1].strip():
                return self._index, self._lines[self._index - 1]
        return None

    def last(self) -> tuple[int, str]:
        """The final line, which a truncated report stops at."""
        return len(self._lines), self._lines[-1] if self._lines else ""


def parse_report(text: str) -> MetricsReport:
    """Parse the text of `torch_xla.debug.metrics.metrics_report()`.

    Raises MetricsReportError, naming the line, for anything torch_xla would not
    have written: a block cut short, a value without its unit, stray text, or a
    name given twice (two reports pasted into one file).
    """
    lines = _Lines(text)
    counters: dict[str, int] = {}
    metrics: dict[str, Metric] = {}
    first_seen: dict[tuple[str, str], int] = {}
    while (numbered := lines.next()) is not None:
        number, line = numbered
        header = _HEADER.fullmatch(line.strip())
        if header is None:
            raise MetricsReportError(
                number, line, "expected a 'Metric: NAME' or 'Counter: NAME' header")
        kind, name = header.group(1), header.group(2).strip()
        if (kind, name) in first_seen:
            raise MetricsReportError(
                number, line,
                f"{kind.lower()} {name!r} appears again (first on line "
                f"{first_seen[kind, name]}); a file must hold one metrics_report(), "
                "so split concatenated reports into separate files")
        first_seen[kind, name] = number
        block = _Block(lines, f"{kind.lower()} {name!r}", number)
        if kind == "Counter":
            counters[name] = block.integer_field("Value")
        else:
            metrics[name] = _read_metric(block, name)
    return MetricsReport(counters=counters, metrics=metrics)


class _Block:
    """Reads the `Field: value` lines that follow a header."""

    def __init__(self, lines: _Lines, owner: str, header_line: int):
        self._lines = lines
        self.owner = f"{owner} (line {header_line})"
        # Where the field last read stands, for errors about its value.
        self.number = header_line
        self.line = ""

    def error(self, problem: str) -> MetricsReportError:
        return MetricsReportError(self.number, self.line, problem)

    def field(self, expected: str) -> tuple[str, str]:
        """The next field's name and value; `expected` names it in errors."""
        numbered = self._lines.next()
        if numbered is None:
            self.number, self.line = self._lines.last()
            raise self.error(
                f"the report ends inside {self.owner} before its {expected} field; the "
                "file looks truncated, save the complete metrics_report() text")
        self.number, self.line = numbered
        if _HEADER.fullmatch(self.line.strip()):
            raise self.error(
                f"{self.owner} is cut short: a new block starts where its {expected} "
                "field should be")
        found = _FIELD.fullmatch(self.line.strip())
        if found is None:
            raise self.error(f"expected the {expected} field of {self.owner}")
        return found.group(1), (found.group(2) or "").strip()

    def expect(self, expected: str) -> str:
        name, value = self.field(expected)
        if name != expected:
            raise self.error(f"expected the {expected} field of {self.owner}, found {name}")
        return value

    def integer_field(self, expected: str) -> int:
        value = self.expect(expected)
        if not _INTEGER.fullmatch(value):
            raise self.error(f"{expected} {value!r} is not a whole number")
        return int(value)


def _read_metric(block: _Block, name: str) -> Metric:
    total_samples = block.integer_field("TotalSamples")
    accumulator_text = block.expect("Accumulator")
    try:
        unit = _unit_of(accumulator_text)
        accumulator = _parse_value(accumulator_text, unit, name)
    except ValueError as error:
        raise block.error(f"Accumulator {error}") from None

    value_rate = samples_per_second = None
    field_name, field_value = block.field("Percentiles")
    if field_name == "ValueRate":
        value_rate = _read_rate(block, field_value, lambda amount: _parse_value(amount, unit, name))
        samples_per_second = _read_rate(block, block.expect("Rate"), _parse_sample_rate)
        field_name, field_value = block.field("Percentiles")
    if field_name != "Percentiles":
        raise block.error(
            f"expected the ValueRate or Percentiles field of {block.owner}, found {field_name}")
    percentiles = {}
    for entry in filter(None, (entry.strip() for entry in field_value.split(";"))):
        percent, equals, value = entry.partition("%=")
        try:
            if not equals:
                raise ValueError(f"{entry!r} is not written like 50%=1.00")
            percentiles[float(percent)] = _parse_value(value, unit, name)
        except ValueError as error:
            raise block.error(f"Percentiles: {error}") from None
    return Metric(name=name, unit=unit, total_samples=total_samples, accumulator=accumulator,
                  value_rate=value_rate, samples_per_second=samples_per_second,
                  percentiles=percentiles)


def _read_rate(block: _Block, text: str, parse) -> float:
    amount, per_second, rest = text.partition(" / second")
    if not per_second or rest:
        raise block.error(f"rate {text!r} does not end in ' / second'")
    try:
        return parse(amount)
    except ValueError as error:
        raise block.error(f"rate {error}") from None


def _parse_sample_rate(text: str) -> float:
    # A plain C++ double, so 226.55, 461255 or 1.23457e+06.
    if not _FLOAT.fullmatch(text):
        raise ValueError(f"{text!r} is not a number of samples like 226.55 or 1.2e+06")
    return float(text)


# ---------------------------------------------------------------- figures

FIGURE_ROWS: tuple[Row, ...] = (
    Row("h2d_transfers", "host-to-device transfers", COUNT),
    Row("h2d_bytes", "host-to-device bytes", BYTES),
    Row("d2h_transfers", "device-to-host transfers", COUNT),
    Row("d2h_bytes", "device-to-host bytes", BYTES),
    Row("tensor_to_data", "TensorToData calls", COUNT),
    Row("compilations", "compilations", COUNT),
    Row("compile_seconds", "compile time", SECONDS),
    Row("executions", "executions", COUNT),
    Row("execute_seconds", "execute time", SECONDS),
)

# Single-device runs record ExecuteTime, replicated (SPMD, multi-device) runs
# ExecuteReplicatedTime; a process may have both.
_EXECUTE_METRICS = ("ExecuteTime", "ExecuteReplicatedTime")


def figures(report: MetricsReport) -> dict[str, int | float]:
    """The headline figures of FIGURE_ROWS.

    A transfer is one batched call to the runtime, whatever the number of
    tensors it moves; OutboundData is what goes to the device and InboundData
    what comes back.
    """
    return {
        "h2d_transfers": report.sample_count("TransferToDeviceTime"),
        "h2d_bytes": round(report.total("OutboundData")),
        "d2h_transfers": report.sample_count("TransferFromDeviceTime"),
        "d2h_bytes": round(report.total("InboundData")),
        "tensor_to_data": report.sample_count("TensorToData"),
        "compilations": report.sample_count("CompileTime"),
        "compile_seconds": report.total("CompileTime"),
        "executions": sum(report.sample_count(name) for name in _EXECUTE_METRICS),
        "execute_seconds": sum(report.total(name) for name in _EXECUTE_METRICS),
    }


def raw_figures(report: MetricsReport) -> dict[str, int | float]:
    """Every counter and metric of the report, keyed as in `raw_rows`."""
    values: dict[str, int | float] = {}
    for metric in report.metrics.values():
        values[f"metric:{metric.name}:samples"] = metric.total_samples
        values[f"metric:{metric.name}:total"] = metric.accumulator
    for name, value in report.counters.items():
        values[f"counter:{name}"] = value
    return values


def raw_rows(reports: Iterable[MetricsReport]) -> list[Row]:
    """Rows for every counter and metric found in any of `reports`: metrics
    first, then counters, each by name."""
    metric_units: dict[str, str] = {}
    counter_names: set[str] = set()
    for report in reports:
        for metric in report.metrics.values():
            metric_units.setdefault(metric.name, metric.unit)
        counter_names.update(report.counters)
    rows = []
    for name in sorted(metric_units):
        rows.append(Row(f"metric:{name}:samples", f"{name} (samples)", COUNT))
        rows.append(Row(f"metric:{name}:total", f"{name} (total)", metric_units[name]))
    rows.extend(Row(f"counter:{name}", name, COUNT) for name in sorted(counter_names))
    return rows
