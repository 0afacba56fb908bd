"""benchmarks/dynamicfl.py runs end to end in --quick mode and prints its one-line verdict last."""

from __future__ import annotations

import pytest

from tests.benchmarks.quick_run import run_benchmark, run_script_help


@pytest.mark.slow
def test_quick_mode_prints_the_verdict_line() -> None:
    last = run_benchmark("dynamicfl", "--quick")[-1]
    figures = dict(item.split("=", 1) for item in last.split())
    assert {"dynamicfl_acc", "fedavg_acc", "gain_by_capacity", "time_ratio_by_capacity"} <= set(figures)
    assert len(figures["gain_by_capacity"].split("/")) == 3
    ratios = [float(r) for r in figures["time_ratio_by_capacity"].split("/")]
    assert ratios[0] == 1.0 and ratios[2] > 1.0  # expanded convs cost time


def test_help_runs_as_a_script() -> None:
    assert "--quick" in run_script_help("dynamicfl")
