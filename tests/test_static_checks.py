"""ruff and mypy, as configured in pyproject.toml, pass on the whole tree (they run in CI through this test).

mypy cannot follow setuptools' editable import hook, so it reads the packages from a tree of symlinks laid out
as the wheel installs them (nestling/server -> server/, ...), the layout every import in the code names.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAPPED = ("methods", "server", "edge", "profiler", "export", "simulator")


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600, check=False)


def _tool(module: str) -> list[str]:
    if (
        shutil.which(module) is None
        and _run([sys.executable, "-m", module, "--version"], REPO).returncode != 0
    ):
        pytest.fail(f"{module} is not installed: run `bash scripts/setup.sh --dev`")
    return [sys.executable, "-m", module]


def test_ruff_lint_is_clean() -> None:
    done = _run([*_tool("ruff"), "check", "--no-cache", "."], REPO)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_is_applied() -> None:
    done = _run([*_tool("ruff"), "format", "--check", "--no-cache", "."], REPO)
    assert done.returncode == 0, "run `.venv/bin/ruff format .`:\n" + done.stdout + done.stderr


def _installed_layout(root: Path) -> Path:
    package = root / "nestling"
    package.mkdir(parents=True)
    for entry in (REPO / "nestling").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for folder in MAPPED:
        (package / folder).symlink_to(REPO / folder)
    return root


@pytest.mark.timeout(900)
def test_mypy_passes_on_every_package(tmp_path: Path) -> None:
    layout = _installed_layout(tmp_path / "layout")
    done = _run(
        [
            *_tool("mypy"),
            "--config-file",
            str(REPO / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / "cache"),
            "-p",
            "nestling",
        ],
        layout,
    )
    assert done.returncode == 0, done.stdout + done.stderr
