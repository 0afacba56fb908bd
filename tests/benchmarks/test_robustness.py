"""benchmarks/robustness.py runs end to end in --quick mode and prints its one-line verdict last."""

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
        [sys.executable, "-m", "benchmarks.robustness", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    figures = dict(pair.split("=", 1) for pair in last.split())
    assert list(figures) == ["attacks", "crashes", "worst_acc_drop", "runs_finished", "honest_overhead"], last
    attacks, crashes = int(figures["attacks"]), int(figures["crashes"])
    assert attacks >= 12 and figures["runs_finished"] == f"{attacks - crashes}/{attacks}", last
    # Every attack a server could die of is named in the table (a crash is reported, not raised).
    assert done.stdout.count("CRASHED") == crashes


def test_help_runs_as_a_script() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/robustness.py", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "--quick" in done.stdout
