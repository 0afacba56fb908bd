"""benchmarks/fedtrans.py runs end to end in --quick mode and prints its one-line verdict last."""

from __future__ import annotations

import re

import pytest

from tests.benchmarks.quick_run import run_benchmark


@pytest.mark.slow
def test_quick_mode_grows_a_family_and_prints_the_verdict_line() -> None:
    lines = run_benchmark("fedtrans", "--quick")
    verdict = re.fullmatch(r"fedtrans_acc=([\d.]+) heterofl_acc=([\d.]+) mac_ratio=([\d.]+)", lines[-1])
    assert verdict, lines[-1]
    assert 0 < float(verdict.group(3)) < 10 and 0 <= float(verdict.group(1)) <= 100
    family = next(line for line in lines if "family (id, parent" in line)
    assert "('m1', 'm0'" in family  # the short run did grow the family
