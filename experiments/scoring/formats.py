"""A score as table text: seconds, speed-ups and their brackets, and Markdown tables."""

from __future__ import annotations

import math

import pandas as pd

from experiments.scoring import intervals

__all__ = ["format_seconds", "format_speedup", "format_speedup_interval", "format_time_interval",
           "markdown_table", "missing"]

def format_seconds(value: float) -> str:
    """Seconds for a table cell: 'not reached' for inf, '-' for missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if math.isinf(value):
        return "not reached"
    if value >= 100:
        return f"{value:.0f} s"
    if value >= 1:
        return f"{value:.1f} s"
    return f"{value * 1000:.0f} ms"


def format_speedup(median: float, low: float, high: float) -> str:
    """A speed-up cell: 'median× [min–max]' over seeds."""
    if median is None or math.isnan(median):
        return "-"

    def one(x: float) -> str:
        return "inf" if math.isinf(x) else f"{x:.2f}"

    if low == high:
        return f"{one(median)}×"
    return f"{one(median)}× [{one(low)}–{one(high)}]"


def format_time_interval(interval: intervals.Interval) -> str:
    """'12.3 s [11.0–13.5]': a median time to target with its bracket ('inf' for a miss)."""
    def end(value: float) -> str:
        return "inf" if math.isinf(value) else format_seconds(value).removesuffix(" s")

    if math.isinf(interval.low):  # every seed missed: 'not reached', no bracket of infinities
        return format_seconds(interval.median)
    return format_seconds(interval.median) + interval.bracket(end)


def format_speedup_interval(interval: intervals.Interval) -> str:
    """'2.10× [1.90–2.30]': a median speed-up with its bracket ('2.10×' without one)."""
    if interval.kind in ("single", "none") or math.isnan(interval.low):
        return format_speedup(interval.median, interval.median, interval.median)
    return format_speedup(interval.median, interval.low, interval.high)


def missing(value: object) -> bool:
    """Whether a table value is absent: None or NaN."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def markdown_table(frame: pd.DataFrame, *, index_name: str | None = None) -> str:
    """Render a small DataFrame (index = first column) as a GitHub Markdown table."""
    head = [index_name or (frame.index.name or ""), *[str(c) for c in frame.columns]]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for idx, row in frame.iterrows():
        cells = [str(idx), *["" if missing(v) else str(v) for v in row.tolist()]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
