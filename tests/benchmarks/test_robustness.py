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
    assert last.startswith("worst_acc_drop=") and " runs_finished=5/5 " in last and "honest_overhead=" in last


def test_help_runs_as_a_script() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/robustness.py", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "--quick" in done.stdout
