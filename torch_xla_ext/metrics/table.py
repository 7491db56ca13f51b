"""Tables of figures: a column per run or report, a line per figure, with the
values that differ from a baseline column marked."""
from __future__ import annotations

from typing import Mapping, Sequence

from torch_xla_ext.metrics.report import BYTES, FIGURE_ROWS, SECONDS, Row


def format_value(value: int | float | str | None, unit: str) -> str:
    """A value in human units: KiB/MiB/GiB for bytes, us/ms/s for seconds; text as it is."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if unit == BYTES:
        if abs(value) < 1024:
            return f"{value:.0f} B"
        for exponent, name in enumerate(["KiB", "MiB", "GiB", "TiB"], start=1):
            if abs(value) < 1024 ** (exponent + 1) or name == "TiB":
                return f"{value / 1024 ** exponent:.2f} {name}"
    if unit == SECONDS:
        if value == 0:
            return "0 s"
        if abs(value) < 1e-6:
            return f"{value * 1e9:.0f} ns"
        if abs(value) < 1e-3:
            return f"{value * 1e6:.1f} us"
        if abs(value) < 1:
            return f"{value * 1e3:.2f} ms"
        return f"{value:.3f} s"
    if isinstance(value, int) or float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:,.2f}"


def _differs(value: int | float | str | None, baseline: int | float | str | None,
             threshold: float) -> bool:
    if not (isinstance(value, (int, float)) and isinstance(baseline, (int, float))):
        return False
    if baseline == 0:
        return value != 0
    return abs(value - baseline) > threshold * abs(baseline)


def format_table(columns: Mapping[str, Mapping[str, int | float | str | None]],
                 baseline: str | None = "loop",
                 rows: Sequence[Row | tuple[str, str, str] | None] | None = None,
                 threshold: float = 0.10, markdown: bool = False) -> str:
    """One table: a column per entry of `columns` (a mode, or a report file), a
    line per row (FIGURE_ROWS by default; None draws a rule), as aligned text
    or, with `markdown`, a GitHub markdown table (`render_rows`).

    A value that differs from the `baseline` column by more than `threshold`
    (relative) is marked with `*`; a value that is missing shows as `-`, and
    text (a status) as it is; neither is ever marked.
    """
    if baseline is not None and baseline not in columns:
        raise ValueError(
            f"baseline column {baseline!r} is not among the columns {list(columns)}; "
            "name one of them, or pass baseline=None to mark nothing")
    rows = FIGURE_ROWS if rows is None else rows
    names = list(columns)
    any_marked = False
    # Headers carry the two characters of the mark column so they align with values.
    table: list[list[str] | None] = [["figure", *(name + "  " for name in names)]]
    for row in rows:
        if row is None:
            table.append(None)
            continue
        key, label, unit = row
        reference = columns[baseline].get(key) if baseline is not None else None
        cells = [label]
        for name in names:
            value = columns[name].get(key)
            marked = name != baseline and _differs(value, reference, threshold)
            any_marked |= marked
            cells.append(format_value(value, unit) + (" *" if marked else "  "))
        table.append(cells)

    text = render_rows(table, markdown)
    if any_marked:
        # In markdown, a line right after the table would be one of its rows,
        # and a line that starts with `*` a list item.
        note = "\n\\*" if markdown else "*"
        text += f"\n{note} differs from {baseline} by more than {threshold:.0%}"
    return text


def render_rows(rows: Sequence[Sequence[str] | None], markdown: bool = False) -> str:
    """Rows of cells as aligned text, the one table format of the project: the
    first column left-aligned, the others right-aligned, two spaces apart;
    None draws a rule. A row shorter than the others ends in free text (a
    run's status), which sets no column's width.

    With `markdown`, the same rows as a GitHub markdown table instead: the
    first row its header, the rules left out, a short row's free text in its
    next cell."""
    count = max(len(cells) for cells in rows if cells is not None)
    if markdown:
        return _markdown_table([cells for cells in rows if cells is not None], count)
    full = [cells for cells in rows if cells is not None and len(cells) == count]
    widths = [max(len(cells[index]) for cells in full) for index in range(count)]
    lines = []
    for cells in rows:
        if cells is None:
            lines.append("-" * (sum(widths) + 2 * (count - 1)))
            continue
        aligned = cells if len(cells) == count else cells[:-1]
        label, *values = aligned
        line = "  ".join([label.ljust(widths[0]),
                          *(value.rjust(width) for value, width in zip(values, widths[1:]))])
        lines.append(line if aligned is cells else f"{line}  {cells[-1]}")
    return "\n".join(line.rstrip() for line in lines)


def _markdown_table(rows: Sequence[Sequence[str]], count: int) -> str:
    """`rows` as a markdown table of `count` columns aligned as `render_rows`
    aligns them; a cell's `|` is escaped, a short row padded with empty cells."""
    def line(cells: Sequence[str]) -> str:
        padded = [cell.strip().replace("|", "\\|") for cell in cells]
        return "| " + " | ".join(padded + [""] * (count - len(cells))) + " |"

    header, *body = rows
    separator = "|" + "|".join(["---", *["---:"] * (count - 1)]) + "|"
    return "\n".join([line(header), separator, *(line(cells) for cells in body)])
