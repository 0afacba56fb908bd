"""Every benchmark starts both as `python benchmarks/X.py` and `python -m benchmarks.X`.

Run as a script, the benchmarks folder comes first on sys.path; with everything under `nestling.` no file
there (profiler.py, export.py, transport.py) can shadow a package Nestling imports.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(path.stem for path in (REPO / "benchmarks").glob("*.py") if not path.stem.startswith("_"))


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_starts_as_a_script_and_as_a_module(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
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
    assert "usage" in as_script.stdout.lower()
    # `python -m benchmarks.X` is the same module run as __main__ from the repo root: run in this process (a second
    # interpreter per benchmark cost the suite a minute of imports), with the same argv.
    argv = sys.argv
    sys.argv = [f"benchmarks/{name}.py", "--help"]
    try:
        with pytest.raises(SystemExit) as exited, warnings.catch_warnings():
            # other tests may have imported benchmarks.X already; runpy warns, and runs it afresh as __main__
            warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
            runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
    finally:
        sys.argv = argv
    assert exited.value.code in (0, None)
    assert "usage" in capsys.readouterr().out.lower()
