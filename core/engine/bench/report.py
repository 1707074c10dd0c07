"""Latency statistics and their presentation as a table and as JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Mean, median and 99th percentile."""
    mean = sum(values) / len(values) if values else float("nan")
    return {"mean": mean, "p50": percentile(values, 50), "p99": percentile(values, 99)}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:,.2f}"
    return str(value)


def format_table(title: str, rows: list[tuple[str, Any]]) -> str:
    """A two-column text table."""
    width = max(len(name) for name, _ in rows)
    lines = [f"{'=' * 8} {title} {'=' * 8}"]
    lines += [f"{name.ljust(width)}  {_fmt(value):>14}" for name, value in rows]
    return "\n".join(lines)


def to_json(data: dict[str, Any]) -> str:
    """JSON with NaN written as null (JSON has no NaN)."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and math.isnan(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(data), indent=2)
