"""benchmarks/planning.py runs end to end in --quick mode and prints its one-line verdict last."""

from __future__ import annotations

import pytest

from tests.benchmarks.quick_run import run_benchmark, run_script_help


@pytest.mark.slow
def test_quick_mode_prints_the_verdict_line() -> None:
    last = run_benchmark("planning", "--quick", timeout=900)[-1]
    keys = [item.split("=")[0] for item in last.split()]
    assert keys == ["deadline_hit_profiled", "deadline_hit_tiers", "time_pred_median_err", "replan_rounds"]
    figures = dict(item.split("=") for item in last.split())
    assert float(figures["deadline_hit_profiled"]) > float(figures["deadline_hit_tiers"])
    assert figures["replan_rounds"] in ("0", "1", "2")


def test_help_runs_as_a_script() -> None:
    assert "--quick" in run_script_help("planning")
