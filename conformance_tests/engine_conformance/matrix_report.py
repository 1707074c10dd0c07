"""Draws the attention coverage matrix of a report as one compact table.

The matrix's capabilities are named ``attention.matrix.<dtype>.<kv_cache_dtype>.<shape>.<feature>``
(see ``test_attention_matrix.py``); here they become a table whose rows are ``shape / feature`` and whose
columns are ``dtype / kv_cache_dtype``. A cell that is not a pass is also listed on its own line with its
detail, below the table, so nothing is lost by the folding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

MATRIX_PREFIX = "attention.matrix."
#: short cell marks; the legend under the table spells them out
MARKS = {"pass": "pass", "fail": "FAIL", "not claimed": "n/c", "not runnable here": "n/r"}
LEGEND = "n/c: not claimed (the detail says why; refused where the contract requires), n/r: not runnable here"


class Row(Protocol):
    """What the table needs of a report row (:class:`engine_conformance.runner.CapabilityResult`)."""

    name: str
    status: str
    detail: str


R = TypeVar("R", bound=Row)


@dataclass(frozen=True, slots=True)
class MatrixCell:
    """One parsed matrix capability name."""

    dtype: str
    kv_cache_dtype: str
    shape: str
    feature: str

    @property
    def column(self) -> str:
        return f"{self.dtype} / {self.kv_cache_dtype}"

    @property
    def row(self) -> str:
        return f"{self.shape} / {self.feature}"


def parse_cell(name: str) -> MatrixCell | None:
    """The cell a capability name denotes, or None when it is not a matrix capability."""
    if not name.startswith(MATRIX_PREFIX):
        return None
    parts = name[len(MATRIX_PREFIX) :].split(".")
    if len(parts) != 4:
        return None
    return MatrixCell(*parts)


def split_rows(rows: list[R]) -> tuple[list[R], list[R]]:
    """``(matrix rows, other rows)``, each in report order."""
    matrix = [r for r in rows if parse_cell(r.name) is not None]
    return matrix, [r for r in rows if parse_cell(r.name) is None]


def _grid(rows: list[Row]) -> tuple[list[str], list[str], dict[tuple[str, str], str]]:
    columns: list[str] = []
    row_names: list[str] = []
    marks: dict[tuple[str, str], str] = {}
    for r in rows:
        cell = parse_cell(r.name)
        assert cell is not None
        if cell.column not in columns:
            columns.append(cell.column)
        if cell.row not in row_names:
            row_names.append(cell.row)
        marks[(cell.row, cell.column)] = MARKS.get(r.status, r.status)
    return columns, row_names, marks


def matrix_markdown(rows: list[Row]) -> list[str]:
    """The matrix as Markdown lines (a heading, the table, the legend, then each non-pass cell); [] if none."""
    matrix, _ = split_rows(rows)
    if not matrix:
        return []
    columns, row_names, marks = _grid(matrix)
    out = [
        "## Attention coverage matrix",
        "",
        "Rows: batch shape / feature; columns: dtype / KV cache dtype. Each cell is the capability "
        "`attention.matrix.<dtype>.<kv_cache_dtype>.<shape>.<feature>`.",
        "",
        "| shape / feature | " + " | ".join(f"`{c}`" for c in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    out += [f"| {r} | " + " | ".join(marks.get((r, c), "") for c in columns) + " |" for r in row_names]
    out += ["", LEGEND]
    others = [r for r in matrix if r.status != "pass"]
    if others:
        out += ["", "| cell | result | detail |", "|---|---|---|"]
        out += [f"| `{r.name}` | {r.status} | {r.detail.replace('|', chr(92) + '|')} |" for r in others]
    return out


def matrix_text(rows: list[Row]) -> list[str]:
    """The matrix as plain-text lines for the terminal; [] if the rows hold none."""
    matrix, _ = split_rows(rows)
    if not matrix:
        return []
    columns, row_names, marks = _grid(matrix)
    first = max(len("shape / feature"), *(len(r) for r in row_names))
    widths = [max(len(c), 4) for c in columns]
    lines = [
        "attention coverage matrix (rows: shape / feature, columns: dtype / KV cache dtype):",
        "  ".join(
            ["shape / feature".ljust(first), *(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
        ),
    ]
    for r in row_names:
        cells = (marks.get((r, c), "").ljust(w) for c, w in zip(columns, widths, strict=True))
        lines.append("  ".join([r.ljust(first), *cells]).rstrip())
    lines.append(LEGEND)
    return lines
