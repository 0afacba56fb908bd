"""benchmarks/planning.py runs end to end in --quick mode and prints its one-line verdict last."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_mode_prints_the_verdict_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.planning", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    keys = [item.split("=")[0] for item in last.split()]
    assert keys == ["deadline_hit_profiled", "deadline_hit_tiers", "time_pred_median_err", "replan_rounds"]
    figures = dict(item.split("=") for item in last.split())
    assert float(figures["deadline_hit_profiled"]) > float(figures["deadline_hit_tiers"])
    assert figures["replan_rounds"] in ("0", "1", "2")


def test_help_runs_as_a_script() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/planning.py", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "--quick" in done.stdout
