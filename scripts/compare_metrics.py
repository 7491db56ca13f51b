#!/usr/bin/env python
"""Compare torch_xla metrics side by side.

  compare_metrics.py diff A.txt B.txt

reads two saved `torch_xla.debug.metrics.metrics_report()` texts and prints the
headline figures, then every counter and metric found in either, one column
per file, marking the values that differ from A by more than 10%.
"""
from __future__ import annotations

import argparse
import os
import sys

from torch_xla_ext.metrics import (
    FIGURE_ROWS, MetricsReport, MetricsReportError, figures, format_table, parse_report,
    raw_figures, raw_rows)


class InputError(Exception):
    """A problem with the user's input, reported as `prog: error: ...` with exit code 2."""


def column_names(paths: list[str]) -> list[str]:
    """File names when they tell the files apart, else the paths as given."""
    base_names = [os.path.basename(path) for path in paths]
    if len(set(base_names)) == len(paths):
        return base_names
    if len(set(paths)) == len(paths):
        return list(paths)
    return [f"{path} ({position})" for position, path in enumerate(paths, start=1)]


def read_report(path: str) -> MetricsReport:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(
            f"{path}: not a text file; expected the text of metrics_report()") from None
    try:
        return parse_report(text)
    except MetricsReportError as error:
        raise InputError(f"{path} {error}") from None


def run_diff(args: argparse.Namespace) -> None:
    paths = [args.baseline_report, args.other_report]
    reports = [read_report(path) for path in paths]
    names = column_names(paths)
    rows = raw_rows(reports)
    columns = {}
    for name, report in zip(names, reports):
        raw = raw_figures(report)
        # torch_xla leaves out counters and metrics that are still zero.
        columns[name] = {**figures(report), **{row.key: raw.get(row.key, 0) for row in rows}}
    print(format_table(columns, baseline=names[0], rows=[*FIGURE_ROWS, None, *rows]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compare_metrics.py",
        description="Compare torch_xla metrics reports side by side.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    diff = commands.add_parser(
        "diff", help="compare two saved metrics_report() texts",
        description="Print the figures of two saved metrics_report() texts side by side, "
                    "marking values of B that differ from A by more than 10%%.")
    diff.add_argument("baseline_report", metavar="A", help="the report to compare against")
    diff.add_argument("other_report", metavar="B", help="the report to compare")
    diff.set_defaults(handler=run_diff)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.handler(args)
    except InputError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
