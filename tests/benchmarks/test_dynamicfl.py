"""benchmarks/dynamicfl.py runs end to end in --quick mode and prints its one-line verdict last."""

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
        [sys.executable, "-m", "benchmarks.dynamicfl", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = dict(item.split("=", 1) for item in done.stdout.strip().splitlines()[-1].split())
    assert {"dynamicfl_acc", "fedavg_acc", "gain_by_capacity", "time_ratio_by_capacity"} <= set(figures)
    assert len(figures["gain_by_capacity"].split("/")) == 3
    ratios = [float(r) for r in figures["time_ratio_by_capacity"].split("/")]
    assert ratios[0] == 1.0 and ratios[2] > 1.0  # expanded convs cost time


def test_help_runs_as_a_script() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/dynamicfl.py", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "--quick" in done.stdout
