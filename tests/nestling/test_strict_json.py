"""Every JSON Nestling writes is strict: a non-finite number is written as null and its path flagged."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from nestling.strict_json import finite_or_null, strict_dumps

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("nestling", "server", "edge", "export", "profiler", "simulator", "benchmarks")


def _strict_loads(text: str):
    def refuse(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_become_null_and_are_listed_by_path() -> None:
    record = {
        "round": 3,
        "train_loss": math.inf,
        "submodels": [{"loss": math.nan, "acc": 0.5}],
        "n": -math.inf,
    }
    text = strict_dumps(record)
    parsed = _strict_loads(text)
    assert parsed["train_loss"] is None and parsed["submodels"][0]["loss"] is None and parsed["n"] is None
    assert parsed["non_finite"] == ["train_loss", "submodels[0].loss", "n"]
    assert parsed["submodels"][0]["acc"] == 0.5 and parsed["round"] == 3


def test_a_finite_record_is_written_unchanged_and_unflagged() -> None:
    record = {"a": [1, 2.5, None, "x"], "b": {"c": True}}
    assert _strict_loads(strict_dumps(record)) == record
    assert finite_or_null(float("1e999")) == (None, ["$"])


def test_non_serialisable_values_still_raise() -> None:
    with pytest.raises(TypeError):
        strict_dumps({"x": object()})


def test_no_product_module_writes_json_without_the_strict_helper() -> None:
    """json.dump/json.dumps write NaN and Infinity by default: files are written through strict_dumps."""
    writers = re.compile(r"json\.dump\(|write_text\(json\.dumps|write\(json\.dumps|writelines\(json\.dumps")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for package in PRODUCT
        for path in sorted((ROOT / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if writers.search(line) and "allow_nan=False" not in line
    ]
    assert offenders == []
