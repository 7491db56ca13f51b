"""torch_xla_ext.metrics and scripts/compare_metrics.py on real torch_xla reports."""
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import assume, given, strategies as st

from torch_xla_ext.metrics import (
    BYTES, COUNT, FIGURE_ROWS, SECONDS, MetricsReportError, Row, figures, format_table,
    format_value, parse_bytes, parse_duration, parse_report)

REPO = Path(__file__).resolve().parent.parent
COMPARE_METRICS = REPO / "scripts" / "compare_metrics.py"
sys.path.insert(0, str(COMPARE_METRICS.parent))
import compare_metrics  # noqa: E402

# Report A after one step; report B after three steps, one more host-to-device
# transfer (8 floats) and one read back of the 4-float result. Also saves
# collect() and torch_xla's own metric values at B to check the parser against.
# All go into the directory `out`, which the source is prefixed with.
WORKLOAD = """
    import json
    import torch, torch_xla
    import torch_xla.debug.metrics as xla_metrics
    import torch_xla.core.xla_model as xm
    from torch_xla_ext.metrics import collect

    device = torch_xla.device()
    xla_metrics.clear_all()

    def step(x):
        x = x * x
        torch_xla.sync()
        return x

    x = step(torch.arange(4.0).to(device))
    xm.wait_device_ops()
    open(out + "/a.txt", "w").write(xla_metrics.metrics_report())

    x = step(step(x))
    extra = torch.ones(8).to(device)
    result = x.cpu()
    xm.wait_device_ops()
    open(out + "/b.txt", "w").write(xla_metrics.metrics_report())
    live = {
        "metrics": {name: xla_metrics.metric_data(name)[:2]
                    for name in xla_metrics.metric_names()},
        "counters": {name: xla_metrics.counter_value(name)
                     for name in xla_metrics.counter_names()},
    }
    # Last: its wait for the device adds a DeviceLockWait sample.
    live["collect"] = collect()
    open(out + "/live.json", "w").write(json.dumps(live))
"""


@pytest.fixture(scope="module")
def reports(tmp_path_factory, scenario_server):
    """Paths of report A, report B and the live values saved at B."""
    out = tmp_path_factory.mktemp("reports")
    # A process of its own (torch_xla's metrics are the process's), forked from
    # the scenario server (isolated.py) that has torch_xla imported already.
    completed = scenario_server.run(f"out = {str(out)!r}\n" + textwrap.dedent(WORKLOAD),
                                    timeout=240, env=dict(os.environ))
    assert completed.returncode == 0, completed.stderr
    return out / "a.txt", out / "b.txt", json.loads((out / "live.json").read_text())


def diff(capsys, *paths) -> tuple[int, str, str]:
    """`compare_metrics.py diff` run in this process: exit code, stdout, stderr."""
    returncode = compare_metrics.main(["diff", *map(str, paths)])
    captured = capsys.readouterr()
    return returncode, captured.out, captured.err


def table_row(table: str, label: str) -> str:
    (line,) = [line for line in table.splitlines() if line.startswith(label + "  ")]
    return line


# ------------------------------------------------------------------ real reports


def test_figures_of_report_after_one_step(reports):
    report_a, _, _ = reports
    assert {key: value for key, value in figures(parse_report(report_a.read_text())).items()
            if not key.endswith("_seconds")} == {
        "h2d_transfers": 1, "h2d_bytes": 16, "d2h_transfers": 0, "d2h_bytes": 0,
        "tensor_to_data": 1, "compilations": 1, "executions": 1,
    }


def test_figures_of_report_after_three_steps_and_an_extra_transfer(reports):
    _, report_b, _ = reports
    report = parse_report(report_b.read_text())
    found = figures(report)
    assert {key: value for key, value in found.items() if not key.endswith("_seconds")} == {
        "h2d_transfers": 2, "h2d_bytes": 16 + 32, "d2h_transfers": 1, "d2h_bytes": 16,
        "tensor_to_data": 2, "compilations": 1, "executions": 3,
    }
    assert 0 < found["compile_seconds"] < 60 and 0 < found["execute_seconds"] < 60
    # The same step graph is compiled once and then found in the cache.
    assert report.counters["UncachedCompile"] == 1 and report.counters["CachedCompile"] == 2


def test_collect_gives_the_figures_of_the_saved_report(reports):
    _, report_b, live = reports
    assert live["collect"] == pytest.approx(figures(parse_report(report_b.read_text())))


def test_parsed_values_match_torch_xla_own_values(reports):
    _, report_b, live = reports
    report = parse_report(report_b.read_text())
    assert report.counters == live["counters"]
    assert set(report.metrics) == set(live["metrics"])
    for name, (total_samples, accumulator) in live["metrics"].items():
        metric = report.metrics[name]
        assert metric.total_samples == total_samples, name
        if metric.unit == SECONDS:  # torch_xla keeps nanoseconds; the report has all digits
            assert metric.accumulator == pytest.approx(accumulator / 1e9, abs=1e-9), name
        elif metric.unit == BYTES:  # two decimals of the largest unit that fits
            assert metric.accumulator == pytest.approx(accumulator, rel=0.005), name
        else:
            assert metric.accumulator == pytest.approx(accumulator, abs=0.005), name
        assert metric.percentiles and all(value >= 0 for value in metric.percentiles.values())


def test_diff_marks_what_changed(reports, capsys):
    report_a, report_b, _ = reports
    returncode, table, errors = diff(capsys, report_a, report_b)
    assert returncode == 0, errors
    assert table.splitlines()[0].split() == ["figure", "a.txt", "b.txt"]
    assert table_row(table, "host-to-device transfers").split()[-3:] == ["1", "2", "*"]
    assert table_row(table, "host-to-device bytes").split()[-5:] == ["16", "B", "48", "B", "*"]
    assert table_row(table, "executions").split()[-3:] == ["1", "3", "*"]
    assert table_row(table, "compilations").split()[-2:] == ["1", "1"]
    # Counters and metrics absent from A (still zero there) appear as 0.
    assert table_row(table, "CachedCompile").split()[-3:] == ["0", "2", "*"]
    assert table_row(table, "TransferFromDeviceTime (samples)").split()[-3:] == ["0", "1", "*"]
    assert table_row(table, "MarkStep").split()[-3:] == ["1", "3", "*"]
    assert table.splitlines()[-1] == "* differs from a.txt by more than 10%"


def test_diff_of_truncated_report_names_the_line(reports, tmp_path, capsys):
    report_a, report_b, _ = reports
    lines = report_b.read_text().splitlines()
    compile_time = lines.index("Metric: CompileTime")
    truncated = tmp_path / "truncated.txt"
    # Cut after the Accumulator, before Percentiles.
    truncated.write_text("\n".join(lines[:compile_time + 3]) + "\n")

    with pytest.raises(MetricsReportError) as raised:
        parse_report(truncated.read_text())
    assert raised.value.line_number == compile_time + 3
    assert raised.value.line == lines[compile_time + 2]
    assert "CompileTime" in str(raised.value) and "truncated" in str(raised.value)

    returncode, table, errors = diff(capsys, report_a, truncated)
    assert returncode == 2
    assert table == ""
    assert errors.startswith(f"compare_metrics.py: error: {truncated} line {compile_time + 3}: ")


def test_diff_from_the_command_line_imports_neither_torch_nor_torch_xla(reports):
    # Reports saved on a TPU host can be compared where torch is not installed.
    report_a, report_b, _ = reports
    completed = subprocess.run(
        [sys.executable, "-c", f"""if True:
            import runpy, sys
            sys.argv = [{str(COMPARE_METRICS)!r}, "diff", {str(report_a)!r}, {str(report_b)!r}]
            try:
                runpy.run_path(sys.argv[0], run_name="__main__")
            finally:
                print(sorted(name for name in sys.modules
                             if name.split(".")[0] in ("torch", "torch_xla")))
        """], capture_output=True, text=True, timeout=60,
        # The script's directory first, as `python scripts/compare_metrics.py`
        # has it, then this checkout's torch_xla_ext.
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(COMPARE_METRICS.parent), str(REPO)])})
    assert completed.returncode == 0, completed.stderr
    table, imported = completed.stdout.rsplit("\n", 2)[:2]
    assert table.splitlines()[0].split() == ["figure", "a.txt", "b.txt"]
    assert imported == "[]"


# ------------------------------------------------------------------ malformed input

SMALL_REPORT = """\
Metric: CompileTime
  TotalSamples: 2
  Accumulator: 02s500ms000.000us
  ValueRate: 500ms000.000us / second
  Rate: 1.23457e+06 / second
  Percentiles: 1%=500ms000.000us; 99.9%=01s000ms000.000us
Metric: TensorsGraphSize
  TotalSamples: 1
  Accumulator: 4.00
  Percentiles: 50%=4.00
Metric: InboundData
  TotalSamples: 1
  Accumulator: 1.50KB
  Percentiles: 50%=1.50KB
Counter: MarkStep
  Value: 3
"""


def test_small_report_fields():
    report = parse_report(SMALL_REPORT)
    compile_time = report.metrics["CompileTime"]
    assert (compile_time.unit, compile_time.total_samples) == (SECONDS, 2)
    # torch_xla writes 1.5 s as 02s500ms...: the whole seconds were rounded up.
    assert compile_time.accumulator == pytest.approx(1.5)
    assert compile_time.value_rate == pytest.approx(0.5)
    assert compile_time.samples_per_second == pytest.approx(1.23457e6)
    assert compile_time.percentiles == pytest.approx({1.0: 0.5, 99.9: 1.0})
    assert report.metrics["TensorsGraphSize"].unit == COUNT
    assert report.metrics["InboundData"].accumulator == 1536
    assert report.counters == {"MarkStep": 3}
    assert parse_report("") == parse_report("\n\n")


@pytest.mark.parametrize("old, new, line_number, problem", [
    ("  Accumulator: 4.00", "  Accumulator: 4", 9, "has no unit"),
    ("  Percentiles: 50%=1.50KB", "  Percentiles: 50%=1.50", 14, "holds sizes"),
    ("  Value: 3", "  Value: three", 16, "not a whole number"),
    ("Counter: MarkStep", "hello world", 15, "expected a 'Metric: NAME' or 'Counter: NAME'"),
    ("  Percentiles: 50%=4.00\n", "", 10, "cut short"),
    ("  Rate: 1.23457e+06 / second", "  Rate: fast / second", 5, "not a number of samples"),
    ("Counter: MarkStep", "Metric: CompileTime", 15, "appears again (first on line 1)"),
])
def test_malformed_report_names_line_and_problem(old, new, line_number, problem):
    assert old in SMALL_REPORT
    text = SMALL_REPORT.replace(old, new)
    with pytest.raises(MetricsReportError) as raised:
        parse_report(text)
    assert raised.value.line_number == line_number
    assert raised.value.line == text.splitlines()[line_number - 1]
    assert problem in str(raised.value)
    assert str(raised.value).startswith(f"line {line_number}: ")


# ------------------------------------------------------------------ units


@pytest.mark.parametrize("text, seconds", [
    ("000.050us", 50e-9),
    ("015.834us", 15.834e-6),
    ("034ms479.927us", 0.034479927),
    # Whole parts that torch_xla rounded up (the rest is half a unit or more).
    ("288ms763.942us", 0.287763942),
    ("04s652ms752.768us", 3.651752768),
    ("01m02s003ms004.005us", 62.003004005),
    ("01d00h00m00s000ms000.000us", 86400.0),
    ("1.5ms", 1.5e-3),
    ("12ns", 12e-9),
    ("2m03s", 123.0),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("text, size", [
    ("16.00B", 16), ("4.00B", 4), ("1.50KB", 1536), ("2.00MB", 2 * 1024**2),
    ("1.25GB", 1.25 * 1024**3), ("3.00TB", 3 * 1024**4), ("1.00PB", 1024**5),
])
def test_parse_bytes(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("parse, text", [
    (parse_duration, "123"), (parse_duration, "12parsecs"), (parse_duration, "01s01s"),
    (parse_duration, "5ms2s"), (parse_duration, ""), (parse_bytes, "16"),
    (parse_bytes, "16.00 B"), (parse_bytes, "1.5KiB"),
])
def test_unparseable_values_say_what_was_expected(parse, text):
    with pytest.raises(ValueError, match="duration|size"):
        parse(text)


def torch_xla_duration(nanoseconds: int) -> str:
    """A duration laid out as torch_xla prints it: from the largest non-zero
    part down to microseconds, each whole part rounded to the nearest integer
    while the smaller parts keep what is left after truncating it."""
    text = ""
    remaining = float(nanoseconds)
    for suffix, scale, width in [("d", 86400e9, 2), ("h", 3600e9, 2), ("m", 60e9, 2),
                                 ("s", 1e9, 2), ("ms", 1e6, 3)]:
        amount = remaining / scale
        if amount >= 1 or text:
            text += f"{amount:0{width}.0f}{suffix}"
            remaining -= math.floor(amount) * scale
    return text + f"{remaining / 1e3:07.3f}us"


@given(st.integers(min_value=0, max_value=30 * 86400 * 10**9))
def test_torch_xla_durations_round_trip(nanoseconds):
    # A remainder of exactly half a unit is ambiguous in torch_xla's layout.
    assume(all(nanoseconds % scale != scale // 2
               for scale in (86400 * 10**9, 3600 * 10**9, 60 * 10**9, 10**9, 10**6)))
    assert parse_duration(torch_xla_duration(nanoseconds)) * 1e9 == pytest.approx(
        nanoseconds, abs=1e-3, rel=1e-15)


@given(st.floats(min_value=0, max_value=1024.0**5 * 1000))
def test_torch_xla_sizes_round_trip_to_printed_precision(size):
    exponent = 0
    while exponent < 5 and size / 1024**exponent >= 1024:
        exponent += 1
    text = f"{size / 1024**exponent:.2f}" + ["B", "KB", "MB", "GB", "TB", "PB"][exponent]
    assert parse_bytes(text) == pytest.approx(size, abs=0.005 * 1024**exponent)


# ------------------------------------------------------------------ table


@pytest.mark.parametrize("value, unit, text", [
    (None, BYTES, "-"), (16, BYTES, "16 B"), (1536, BYTES, "1.50 KiB"),
    (3 * 1024**3, BYTES, "3.00 GiB"), (0.0, SECONDS, "0 s"), (12e-9, SECONDS, "12 ns"),
    (67.9e-6, SECONDS, "67.9 us"), (0.0123, SECONDS, "12.30 ms"), (2.5, SECONDS, "2.500 s"),
    (1234567, COUNT, "1,234,567"), (4.0, COUNT, "4"), (2.25, COUNT, "2.25"),
])
def test_format_value(value, unit, text):
    assert format_value(value, unit) == text


def test_format_table_marks_changes_over_ten_percent():
    rows = [Row("steps", "steps", COUNT), Row("rss", "peak RSS", BYTES),
            Row("params", "HLO parameters", COUNT)]
    table = format_table({
        "loop": {"steps": 100, "rss": 1024**2, "params": None},
        "scan": {"steps": 110, "rss": 2 * 1024**2, "params": 7},
        "torch-xla-scan": {"steps": 111, "rss": 0},
    }, rows=rows)
    lines = table.splitlines()
    assert lines[0].split() == ["figure", "loop", "scan", "torch-xla-scan"]
    assert lines[1].split() == ["steps", "100", "110", "111", "*"]  # 10% exactly is not marked
    assert lines[2].split() == ["peak", "RSS", "1.00", "MiB", "2.00", "MiB", "*", "0", "B", "*"]
    assert lines[3].split() == ["HLO", "parameters", "-", "7", "-"]  # nothing to compare
    assert lines[4] == "* differs from loop by more than 10%"
    assert len({len(line.rstrip(" *")) for line in lines[:4]}) == 1  # right-aligned columns


def test_format_table_as_markdown():
    rows = [Row("steps", "steps", COUNT), None, Row("rss", "peak RSS", BYTES)]
    table = format_table({"loop": {"steps": 100, "rss": 1024**2},
                          "scan": {"steps": 120, "rss": None}}, rows=rows, markdown=True)
    # A header row, the separator row, a row per figure (no rule); the note on
    # the marks a paragraph of its own, its `*` escaped.
    assert table.splitlines() == [
        "| figure | loop | scan |",
        "|---|---:|---:|",
        "| steps | 100 | 120 * |",
        "| peak RSS | 1.00 MiB | - |",
        "",
        "\\* differs from loop by more than 10%"]


def test_format_table_defaults_to_the_figure_rows():
    figures_of = dict.fromkeys([row.key for row in FIGURE_ROWS], 1)
    table = format_table({"loop": figures_of, "scan": figures_of})
    assert [line.split("  ")[0] for line in table.splitlines()[1:]] == [
        row.label for row in FIGURE_ROWS]
    assert "*" not in table


def test_format_table_without_baseline_marks_nothing():
    table = format_table({"a": {"x": 1}, "b": {"x": 5}}, baseline=None,
                         rows=[Row("x", "x", COUNT)])
    assert "*" not in table


def test_format_table_rejects_unknown_baseline():
    with pytest.raises(ValueError, match="baseline column 'loop' is not among"):
        format_table({"scan": {}})


def test_hlo_parameter_count_reads_the_entry_computation():
    from torch_xla_ext.metrics import hlo_parameter_count
    text = ("HloModule m\n\n%helper (a: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n}\n\n"
            "ENTRY %main (p0: f32[2], p1: f32[2]) -> f32[2] {\n  %p0 = f32[2] parameter(0)\n"
            "  %p1 = f32[2] parameter(1)\n  ROOT %add = f32[2] add(%p0, %p1)\n}\n")
    assert hlo_parameter_count(text) == 2


# A partitioned module as XLA:CPU prints it: a loop of 3 iterations whose body
# gathers a weight (its fusion reduces nothing), an all-reduce of a tuple after it.
PARTITIONED = """HloModule m

%fused (p: f32[2,4]) -> f32[2,4] {
  %p = f32[2,4]{1,0} parameter(0)
  ROOT %n = f32[2,4]{1,0} negate(%p)
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (state: (s64[], f32[1,4])) -> (s64[], f32[1,4]) {
  %state = (s64[], f32[1,4]{1,0}) parameter(0)
  %w = f32[1,4]{1,0} get-tuple-element(%state), index=1
  %all-gather.1 = f32[2,4]{1,0} all-gather(%w), channel_id=1, replica_groups={{0,1}}, dimensions={0}
  %fusion = f32[2,4]{1,0} fusion(%all-gather.1), kind=kLoop, calls=%fused
  ROOT %t = (s64[], f32[1,4]{1,0}) tuple(%i, %w)
}

%cond (state: (s64[], f32[1,4])) -> pred[] {
  %state = (s64[], f32[1,4]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (p0: f32[1,4], p1: bf16[8]) -> f32[1,4] {
  %p0 = f32[1,4]{1,0} parameter(0)
  %p1 = bf16[8]{0} parameter(1)
  %init = (s64[], f32[1,4]{1,0}) tuple(%zero, %p0)
  %while = (s64[], f32[1,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"},"known_init_step":{"init":"0","step":"1"}}
  %all-reduce = (f32[1,4]{1,0}, bf16[8]{0}) all-reduce(%p0, %p1), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  %collective-permute-done = bf16[8]{0} collective-permute-done(%start)
  ROOT %r = f32[1,4]{1,0} get-tuple-element(%while), index=1
}
"""


def test_collectives_count_a_loop_body_once_per_iteration():
    from torch_xla_ext.metrics.hlo import collective_totals, executions_per_run
    runs = executions_per_run(PARTITIONED)
    assert (runs["main"], runs["body"], runs["cond"], runs["fused"]) == (1, 3, 4, 3)
    assert "add" in runs  # the all-reduce's reduction
    totals = collective_totals(PARTITIONED)
    assert totals["all-gather"] == {"count": 3, "bytes": 3 * 2 * 4 * 4}
    assert totals["all-reduce"] == {"count": 1, "bytes": 4 * 4 + 8 * 2}
    assert totals["collective-permute"] == {"count": 1, "bytes": 8 * 2}
    assert totals["reduce-scatter"] == totals["all-to-all"] == {"count": 0, "bytes": 0}


def test_a_loop_without_a_known_trip_count_is_refused():
    from torch_xla_ext.metrics.hlo import collectives
    with pytest.raises(ValueError, match="without a known trip count"):
        collectives(PARTITIONED.replace('"known_trip_count":{"n":"3"},', ""))


def test_total_bytes_used_reads_a_buffer_assignment():
    from torch_xla_ext.metrics.hlo import total_bytes_used
    assert total_bytes_used("BufferAssignment:\nTotal bytes used: 4379112 (4.18MiB)\n") == 4379112
    with pytest.raises(ValueError, match="no 'Total bytes used:' line"):
        total_bytes_used("HloModule m")


def test_peak_rss_follows_an_allocation_after_a_reset():
    from torch_xla_ext.metrics import peak_rss_bytes, reset_peak_rss
    assert reset_peak_rss()
    before = peak_rss_bytes()
    block = bytearray(64 * 2**20)  # touched pages count toward RSS
    assert peak_rss_bytes() - before >= 60 * 2**20
    del block


# ---------------------------------------------------------------- op times

def op_events(offset: float) -> list[dict]:
    """One execution as XLA:CPU's runtime traces it, times in microseconds from
    `offset`: a product, a copy beside it, a kernel split across threads (its
    `call` wrapper), all inside a while loop; and a runtime event of no op."""
    def op(name, start, end):
        return [{"ph": "X", "name": name, "ts": offset + start, "dur": 0.5},
                {"ph": "X", "name": f"end: {name}", "ts": offset + end, "dur": 0}]
    return [*op("while.3", 0, 20), *op("dot.1", 0, 10), *op("copy.2", 5, 15),
            *op("call.4", 16, 18), *op("multiply_fusion.5.clone", 16, 18),
            {"ph": "X", "name": "ThunkExecutor::Execute", "ts": offset, "dur": 20},
            {"ph": "M", "name": "thread_name", "args": {"name": "worker"}}]


def test_op_times_share_the_busy_time_among_the_ops_running_at_once():
    from torch_xla_ext.metrics import OpKind, op_times
    times = op_times(op_events(0) + op_events(100), executions=2)
    # dot alone for 5 us, beside the copy for 5, the copy alone for 5, the
    # fusion for 2; while and call only hold ops.
    assert list(times.kinds) == ["dot", "copy", "multiply_fusion"]
    def kind(wall, busy):
        return OpKind(count=1, wall_seconds=pytest.approx(wall), busy_seconds=pytest.approx(busy))

    assert times.kinds == {"dot": kind(7.5e-6, 10e-6), "copy": kind(7.5e-6, 10e-6),
                           "multiply_fusion": kind(2e-6, 2e-6)}
    assert times.busy_seconds == pytest.approx(17e-6)
    # Alone: the dot 5 us, the copy 5, the fusion 2; two at once: 5.
    assert times.concurrency == {1: pytest.approx(12e-6), 2: pytest.approx(5e-6)}


@pytest.mark.parametrize("instruction, kind", [
    ("dynamic-slice_bitcast_fusion.3.clone", "dynamic-slice_bitcast_fusion"),
    ("copy.124", "copy"), ("broadcast.106.clone", "broadcast"), ("dot", "dot"),
    ("wrapped_scatter.2", "wrapped_scatter")])
def test_op_kind_is_the_instruction_without_its_numbering(instruction, kind):
    from torch_xla_ext.metrics import op_kind
    assert op_kind(instruction) == kind


def test_op_times_of_a_trace_without_ops_say_where_to_record_one():
    from torch_xla_ext.metrics import OpTimesError, op_times
    events = [{"ph": "X", "name": "ThunkExecutor::Execute", "ts": 0, "dur": 20},
              *op_events(0)[:2]]  # the while loop alone
    with pytest.raises(OpTimesError, match=r"no op spans .* no op ran .* than PJRT's CPU"):
        op_times(events)


@pytest.mark.parametrize("executions", [0, -1, 1.5, True, "2"])
def test_op_times_refuse_a_count_of_executions_that_is_not_one_or_more(executions):
    from torch_xla_ext.metrics import op_times
    with pytest.raises(ValueError, match=rf"executions must be .* 1 or more, got {executions!r}"):
        op_times(op_events(0), executions)


def test_read_trace_events_reads_the_newest_saved_trace(tmp_path):
    import gzip
    from torch_xla_ext.metrics import OpTimesError, read_trace_events
    with pytest.raises(OpTimesError, match=rf"{tmp_path}: holds no profiler trace"):
        read_trace_events(str(tmp_path))
    for name, events in (("old", [{"name": "old"}]), ("new", op_events(0))):
        folder = tmp_path / "plugins" / "profile" / name
        folder.mkdir(parents=True)
        with gzip.open(folder / "host.trace.json.gz", "wt") as file:
            json.dump({"traceEvents": events}, file)
        os.utime(folder / "host.trace.json.gz", (1, 1) if name == "old" else None)
    assert read_trace_events(str(tmp_path)) == op_events(0)


def measured_matmul_op_times():
    """Records two executions of a product plus one on PJRT CPU."""
    import torch
    import torch_xla
    from torch_xla_ext.metrics import measure_op_times
    a = torch.randn(64, 64, device=torch_xla.device())

    def run():
        return a @ a + 1

    run()
    torch_xla.sync()  # compiled before the recording
    times = measure_op_times(run, executions=2)
    print(json.dumps({"kinds": {kind: ops.count for kind, ops in times.kinds.items()},
                      "busy": times.busy_seconds,
                      "wall": sum(ops.wall_seconds for ops in times.kinds.values())}))


def test_measure_op_times_refuses_what_it_cannot_call_before_recording():
    import torch
    from torch_xla_ext.metrics import measure_op_times
    with pytest.raises(TypeError, match=r"run must be a function .* got Tensor"):
        measure_op_times(torch.ones(2))


def test_measure_op_times_records_the_executions_of_a_graph(run_isolated):
    result = run_isolated(measured_matmul_op_times)
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.splitlines()[-1])
    assert measured["kinds"].get("dot") == 1, measured
    assert measured["busy"] > 0 and measured["wall"] == pytest.approx(measured["busy"])
