"""How numbers read wherever Nestling prints them: an accuracy is a percent with one decimal, so the progress
bar, the run table, `nestling server`'s last line and the demo all say the same figure summary.json holds."""

from __future__ import annotations

import math

MIB = 1024 * 1024


def percent(fraction: float | None) -> str:
    """0.51234 -> '51.2%'; a missing or non-finite value -> '–'."""
    if fraction is None or not math.isfinite(fraction):
        return "–"
    return f"{100 * fraction:.1f}%"


def mebibytes(count: float | None) -> str:
    """Bytes as MiB with one decimal ('16.8'); a missing value -> '–'."""
    return "–" if count is None else f"{count / MIB:.1f}"


def seconds(value: float | None) -> str:
    """Seconds with two decimals ('0.42'); a missing value -> '–'."""
    return "–" if value is None else f"{float(value):.2f}"


def headline(summary: dict) -> str:
    """'worst 10.0%, average 51.6%': a run's summary.json figures, the one way every command prints them."""
    return f"worst {percent(summary.get('worst_accuracy'))}, average {percent(summary.get('avg_accuracy'))}"


__all__ = ["MIB", "headline", "mebibytes", "percent", "seconds"]
