"""Run a benchmark as users do (`python -m benchmarks.NAME ARGS`) with one torch thread; its stdout lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_benchmark(name: str, *args: str, timeout: float = 600) -> list[str]:
    """stdout lines of a benchmark run that exited 0 (its stderr tail in the failure message otherwise)."""
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()


def run_script_help(name: str) -> str:
    """`python benchmarks/NAME.py --help` from the repo root: its stdout (it must exit 0)."""
    done = subprocess.run(
        [sys.executable, f"benchmarks/{name}.py", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
