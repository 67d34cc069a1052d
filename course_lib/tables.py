"""Rows of results as a text table: the one way the course prints a table, chapter 00 on.

    print(table(rows, [("mode", "mode", ""), ("ms/step", "ms_per_step", ".1f"), ("speed-up", "speedup", ".2f")]))

Each column is (header, where its value comes from, format spec): a key of the row (a dict, or
an attribute of a dataclass) or a function of the row, and a spec for Python's `format` ("" for
text as it is). Numbers are formatted by the spec; None prints "n/a". Columns are as wide as
their widest cell, two spaces apart: the first and those whose spec starts with "<" are aligned
left, the others right.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

__all__ = ["table"]

Column = tuple[str, "str | Callable[[Any], Any]", str]


def table(
    rows: Iterable[Any],
    columns: Sequence[Column],
    *,
    skipped: Callable[[Any], str | None] | None = None,
    missing: str = "n/a",
) -> str:
    """Chapter 00: `rows` as an aligned text table, one column per (header, key or function, format spec).

    `skipped(row)`, where given, returns the text of a row that was not measured (its first cell
    then stands beside that text, across the other columns), or None for a measured row.
    """
    grid = [[header for header, _, _ in columns]]
    notes: dict[int, str] = {}  # line number -> what a skipped row says instead of its cells
    for row in rows:
        note = skipped(row) if skipped else None
        cells = []
        for _, where, spec in columns if note is None else columns[:1]:
            value = where(row) if callable(where) else _value(row, where)
            cells.append(missing if value is None else format(value, spec))
        if note is not None:
            notes[len(grid)] = note
        grid.append(cells)
    widths = [max(len(line[i]) for line in grid if i < len(line)) for i in range(len(columns))]
    left = [i == 0 or spec.startswith("<") for i, (_, _, spec) in enumerate(columns)]
    out = []
    for n, line in enumerate(grid):
        text = [cell.ljust(w) if lft else cell.rjust(w) for cell, w, lft in zip(line, widths, left)]
        out.append("  ".join(text + ([notes[n]] if n in notes else [])).rstrip())
    return "\n".join(out)


def _value(row: Any, key: str) -> Any:
    return row.get(key) if isinstance(row, dict) else getattr(row, key, None)
