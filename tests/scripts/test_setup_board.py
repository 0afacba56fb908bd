"""scripts/setup.sh --board refuses what cannot work, with the reason, before it makes a venv or downloads:
a 32-bit OS (also a 64-bit kernel under a 32-bit userland, as 32-bit Raspberry Pi OS on a Pi 4 ships), a Python
older than 3.10, a JetPack older than 6, a Jetson without NVIDIA's torch; and it keeps a system torch.
On a board venv it removes the dependencies' test suites, test data and torch's protoc and headers, and
nothing beside them, unless the keep switches say otherwise.

The interpreter is a stand-in that answers setup.sh's probe as such a board would and runs every other
`python -c` with this host's Python; the slow board check (tests/scripts/test_board_check_arm64.py) runs the
real install on an arm64 userland.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_setup(
    tmp_path: Path, probe: str, tegra: str | None = None, *args: str, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """setup.sh --board from a copy of scripts/ (so no .venv lands in the repo), on a board whose Python
    answers the probe with `probe` ("machine bits major minor torch-or--") and refuses to make venvs."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    python = tmp_path / "python3"
    python.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = - ]; then cat >/dev/null; echo "{probe}"; exit 0; fi\n'
        'if [ "$1" = -m ] && [ "$2" = venv ]; then echo "venv would be made here" >&2; exit 3; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    release = tmp_path / "nv_tegra_release"
    if tegra is not None:
        release.write_text(tegra)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(python), "NESTLING_TEGRA_RELEASE": str(release)}
    env.update(extra_env or {})
    return subprocess.run(
        ["bash", str(tmp_path / "scripts" / "setup.sh"), *(args or ("--board",))],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    "probe",
    ["armv7l 32 3 11 -", "aarch64 32 3 11 -", "armv6l 32 3 11 -"],
    ids=["armv7l", "64-bit-kernel-32-bit-userland", "pi-zero"],
)
def test_a_32_bit_os_gets_a_clear_error(tmp_path: Path, probe: str) -> None:
    done = run_setup(tmp_path, probe)
    assert done.returncode == 1
    assert "32-bit system" in done.stderr and "Raspberry Pi OS 64-bit" in done.stderr, done.stderr
    assert not (tmp_path / ".venv").exists()


def test_an_older_python_is_named(tmp_path: Path) -> None:
    done = run_setup(tmp_path, "aarch64 64 3 9 -")
    assert done.returncode == 1 and "needs Python >= 3.10; " in done.stderr and "is 3.9" in done.stderr


@pytest.mark.parametrize(
    ("release", "jetpack", "python"),
    [
        ("# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64\n", "5", "3.8"),
        ("# R32 (release), REVISION: 7.4, GCID: 33514132, BOARD: t210ref, EABI: aarch64\n", "4", "3.6"),
    ],
)
def test_an_older_jetpack_gets_a_clear_error(tmp_path: Path, release: str, jetpack: str, python: str) -> None:
    done = run_setup(tmp_path, "aarch64 64 3 8 -", release)
    assert done.returncode == 1
    assert f"runs JetPack {jetpack}; Nestling supports JetPack 6" in done.stderr, done.stderr
    assert f"Python {python}" in done.stderr


JETPACK_6 = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64\n"


def test_a_jetson_without_nvidias_torch_is_told_to_install_it_first(tmp_path: Path) -> None:
    done = run_setup(tmp_path, "aarch64 64 3 10 -", JETPACK_6)
    assert done.returncode == 1 and "install NVIDIA's PyTorch for JetPack 6 first" in done.stderr


def test_a_system_torch_is_kept_through_the_venvs_system_site_packages(tmp_path: Path) -> None:
    done = run_setup(tmp_path, "aarch64 64 3 10 2.5.0", JETPACK_6)
    assert "keeping the system's torch 2.5.0" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 3 and "venv would be made here" in done.stderr  # the stand-in stops it there


def test_a_system_torch_outside_the_range_is_refused_not_shadowed(tmp_path: Path) -> None:
    done = run_setup(tmp_path, "aarch64 64 3 11 2.0.1")
    assert done.returncode == 1 and "torch 2.0.1 is outside the range" in done.stderr


def test_an_unknown_flag_is_refused(tmp_path: Path) -> None:
    done = run_setup(tmp_path, "x86_64 64 3 11 -", None, "--bord")
    assert done.returncode == 2 and "usage: bash scripts/setup.sh [--dev | --board]" in done.stderr


# A board venv's site-packages in miniature: what setup.sh --board removes, and its neighbours that must stay.
REMOVED = [
    "onnx/backend/test/data/node/test_abs/model.onnx",
    "sympy/polys/tests/test_polytools.py",
    "sympy/testing/tests/test_pytest.py",
    "numpy/_core/tests/test_multiarray.py",
    "networkx/algorithms/tests/test_cycles.py",
    "torch/bin/protoc",
    "torch/bin/protoc-3.13.0.0",
    "torch/include/ATen/ATen.h",
]
KEPT = [
    "onnx/backend/test/__init__.py",
    "onnx/backend/test/case/node/abs.py",
    "sympy/testing/runtests.py",
    "sympy/polys/polytools.py",
    "numpy/testing/__init__.py",
    "networkx/algorithms/cycles.py",
    "torch/bin/torch_shm_manager",
    "torch/fx/passes/tests/__init__.py",
    "other/tests/test_other.py",
]


def board_venv(tmp_path: Path) -> Path:
    """A .venv whose python is this host's (it imports torch, so setup.sh installs none) and whose pip does
    nothing, over a site-packages holding every file of REMOVED and KEPT."""
    site = tmp_path / ".venv" / "lib" / "python3.11" / "site-packages"
    for name in REMOVED + KEPT:
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text("x")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then exit 0; fi\nexec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    return site


def test_a_board_venv_goes_without_its_dependencies_test_suites_and_keeps_what_runs(tmp_path: Path) -> None:
    site = board_venv(tmp_path)
    done = run_setup(tmp_path, "aarch64 64 3 11 -")
    assert done.returncode == 0, done.stderr
    assert "NESTLING_KEEP_PACKAGE_TESTS=1 keeps them" in done.stdout, done.stdout
    assert [name for name in REMOVED if (site / name).exists()] == []
    assert [name for name in KEPT if not (site / name).exists()] == []
    assert not (site / "onnx/backend/test/data").exists() and not (site / "sympy/polys/tests").exists()


def test_the_keep_switches_keep_the_test_suites_and_the_headers(tmp_path: Path) -> None:
    site = board_venv(tmp_path)
    keep = {"NESTLING_KEEP_PACKAGE_TESTS": "1", "NESTLING_KEEP_TORCH_HEADERS": "1"}
    done = run_setup(tmp_path, "aarch64 64 3 11 -", extra_env=keep)
    assert done.returncode == 0, done.stderr
    assert [name for name in REMOVED + KEPT if not (site / name).exists()] == []
