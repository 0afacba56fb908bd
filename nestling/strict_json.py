"""Strict JSON for every file Nestling writes: a non-finite number becomes null, and the record says where.

Python's json writes NaN and Infinity, which no other JSON reader accepts (jq, JavaScript, pandas' strict
mode). A diverged loss or a board's 1e999 must stay visible without making metrics.jsonl or summary.json
unreadable: `strict_dumps` writes it as null and lists its path under `non_finite`; `allow_nan=False` is the
guard that nothing slipped through.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

NON_FINITE_KEY = "non_finite"


def finite_or_null(value: Any, path: str = "") -> tuple[Any, list[str]]:
    """`value` with every NaN/±Inf float replaced by None, and the paths (a.b[2]) of those replaced."""
    if isinstance(value, float):
        return (value, []) if math.isfinite(value) else (None, [path or "$"])
    if isinstance(value, dict):
        out, where = {}, []
        for key, item in value.items():
            out[key], found = finite_or_null(item, f"{path}.{key}" if path else str(key))
            where += found
        return out, where
    if isinstance(value, (list, tuple)):
        items, where = [], []
        for i, item in enumerate(value):
            clean, found = finite_or_null(item, f"{path}[{i}]")
            items.append(clean)
            where += found
        return items, where
    return value, []


def strict_dumps(value: Any, *, flag: bool = True, **options: Any) -> str:
    """JSON text with no NaN/Infinity: they are written as null and, when `value` is an object and `flag` is
    set, their paths are listed under its "non_finite" key."""
    clean, where = finite_or_null(value)
    if where and flag and isinstance(clean, dict):
        clean[NON_FINITE_KEY] = where
    return json.dumps(clean, allow_nan=False, **options)


def write_strict_json(path: Path, value: Any, **options: Any) -> None:
    """Write `value` to `path` as strict JSON (see strict_dumps), with a trailing newline."""
    path.write_text(strict_dumps(value, **options) + "\n")
