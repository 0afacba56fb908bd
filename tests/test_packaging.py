"""The wheel installs one top-level name, `nestling`, and every product folder lands inside it.

A toolkit that installs `server`, `profiler` or `export` into site-packages collides with its users' own
modules (and onnxruntime's `profiler.py`); the folders stay at the repository's top level for their layout,
mapped under `nestling.` by pyproject's package-dir.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
PRODUCT_FOLDERS = ("nestling", "methods", "server", "edge", "profiler", "export", "simulator")


def _python_packages_on_disk() -> set[str]:
    """Every folder with an __init__.py under the product folders, named as it installs."""
    found = set()
    for top in PRODUCT_FOLDERS:
        for init in (REPO / top).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            parts = init.parent.relative_to(REPO).parts
            found.add(".".join(parts if top == "nestling" else ("nestling", *parts)))
    return found


def test_pyproject_lists_every_package_under_the_namespace() -> None:
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(tool["packages"]) == _python_packages_on_disk()
    assert all(name == "nestling" or name.startswith("nestling.") for name in tool["packages"])
    for name, folder in tool["package-dir"].items():
        assert (REPO / folder / "__init__.py").exists(), f"{name} maps to {folder}, which is not a package"


@pytest.mark.timeout(300)
def test_a_fresh_wheel_installs_nothing_at_top_level_but_nestling(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("nestling-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"nestling", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    for package in _python_packages_on_disk():
        assert f"{package.replace('.', '/')}/__init__.py" in names, f"{package} missing from the wheel"
    assert "nestling/server/coordinator.py" in names and "nestling/export/infer.py" in names
    assert "nestling/methods/depthfl/exit_head.py" in names and "nestling/methods/dynamicfl/dbb.py" in names


def test_the_old_top_level_names_do_not_import(tmp_path: Path) -> None:
    """From outside the repository (no cwd on the path), only the namespaced names resolve."""
    probe = (
        "import importlib.util as u, sys;"
        "old = [n for n in ('methods', 'server', 'edge', 'profiler', 'export', 'simulator') if u.find_spec(n)];"
        "import nestling.methods.fedtrans, nestling.server.coordinator, nestling.edge.trainer, nestling.profiler.estimator,"
        " nestling.export.bundle, nestling.simulator.run;"
        "sys.exit(f'importable at top level: {old}' if old else 0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr or done.stdout
