"""Every benchmark starts both as `python benchmarks/X.py` and `python -m benchmarks.X`.

Run as a script, the benchmarks folder comes first on sys.path; with everything under `nestling.` no file
there (profiler.py, export.py, transport.py) can shadow a package Nestling imports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(path.stem for path in (REPO / "benchmarks").glob("*.py") if not path.stem.startswith("_"))


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_starts_as_a_script_and_as_a_module(name: str, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    as_script = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / f"{name}.py"), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert as_script.returncode == 0, as_script.stderr
    as_module = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert as_module.returncode == 0, as_module.stderr
    assert "usage" in as_script.stdout.lower() and "usage" in as_module.stdout.lower()
