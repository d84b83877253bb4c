"""Plain-text tables: the one formatter of every table this project prints (run reports, the
all-reduce check, the benchmarks, the planner). Standard library only.

Cells arrive as strings, formatted by the caller (units and precision are the caller's
business); this module only sizes and aligns the columns.
"""

from __future__ import annotations

from collections.abc import Sequence


def text_table(
    rows: Sequence[Sequence[str]],
    *,
    headers: Sequence[str] | None = None,
    align: str = "",
    gap: str = "  ",
    indent: str = "",
    rule: bool = False,
) -> list[str]:
    """The lines of a table, each column as wide as its widest cell.

    ``align`` holds one character per column, ``<`` (left, the default for columns it does not
    cover) or ``>`` (right); ``rule`` puts a line of dashes under the headers. Trailing spaces
    are removed. A row shorter than the others leaves its last columns empty."""
    body = [list(headers)] if headers is not None else []
    body += [list(row) for row in rows]
    if not body:
        return []
    columns = max(len(row) for row in body)
    if any(a not in "<>" for a in align) or len(align) > columns:
        raise ValueError(f"align {align!r}: one of '<' or '>' per column ({columns} columns)")
    cells = [row + [""] * (columns - len(row)) for row in body]
    widths = [max(len(row[i]) for row in cells) for i in range(columns)]
    aligns = align.ljust(columns, "<")

    def line(row: Sequence[str]) -> str:
        parts = [
            cell.rjust(width) if a == ">" else cell.ljust(width)
            for cell, width, a in zip(row, widths, aligns, strict=True)
        ]
        return (indent + gap.join(parts)).rstrip()

    lines = [line(row) for row in cells]
    if rule and headers is not None:
        lines.insert(1, indent + gap.join("-" * w for w in widths))
    return lines
