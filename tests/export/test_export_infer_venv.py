"""`infer` in a fresh venv with onnxruntime, numpy, msgspec and Pillow but no torch: the same top-1 as PyTorch.

The environment is a plain venv (not --system-site-packages, which would leak this one's torch),
cached in pytest's cache folder so later runs skip the install; it is checked to lack torch each time.
Measured here: 17 s with a fresh venv and install, 5 s with the cached one (under the 30 s `slow` bar).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nestling.export.pipeline import ExportData, ExportOptions, export_submodel
from nestling.export.reference import reference_model
from nestling.export.source import open_checkpoint, select_target

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ["onnxruntime", "numpy", "msgspec", "pillow"]
PROBE = "import onnxruntime, numpy, msgspec, PIL, importlib.util as u; assert u.find_spec('torch') is None, 'has torch'"


def _python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _torchless_venv(cache: pytest.Cache | None, scratch: Path) -> Path:
    """Reused across runs through pytest's cache; a scratch folder when the cache plugin is off."""
    venv = (cache.mkdir("export-infer-venv") if cache is not None else scratch) / "venv"
    python = _python(venv)
    if (
        python.exists()
        and subprocess.run([str(python), "-c", PROBE], check=False, capture_output=True).returncode == 0
    ):
        return venv
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True)
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *PACKAGES],
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"pip could not install {', '.join(PACKAGES)} from the package index: {last[0]}")
    probe = subprocess.run([str(python), "-c", PROBE], check=False, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    return venv


def test_infer_in_a_torchless_venv_matches_pytorch_top1_on_100_images(
    request: pytest.FixtureRequest,
    nefl_checkpoint: Path,
    cifar_data: ExportData,
    cifar100_images: tuple[np.ndarray, np.ndarray],
    tmp_path: Path,
) -> None:
    from PIL import Image

    venv = _torchless_venv(getattr(request.config, "cache", None), tmp_path / "scratch")
    bundle = tmp_path / "bundle"
    export_submodel(
        nefl_checkpoint,
        bundle,
        submodel="k5",
        data=cifar_data,
        options=ExportOptions(benchmark=False, parity_samples=16),
    )
    pixels = cifar100_images[0]
    images = []
    for i, image in enumerate(pixels):
        images.append(tmp_path / f"cifar{i:03d}.png")
        Image.fromarray(image).save(images[-1])

    # Nestling installed as a board would (its wheel, no dependencies): no torch to fall back on.
    wheels = tmp_path / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    subprocess.run(
        [
            str(_python(venv)),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "-q",
            "--no-deps",
            "--force-reinstall",
            *map(str, wheels.glob("nestling-*.whl")),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(_python(venv)), "-m", "nestling.export.infer", "--bundle", str(bundle), *map(str, images)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    predicted = [int(line.split("\t")[1]) for line in done.stdout.strip().splitlines()]

    net = reference_model(select_target(open_checkpoint(nefl_checkpoint), submodel="k5"))
    with torch.no_grad():
        expected = net(cifar_data.heldout_x).argmax(1).tolist()
    assert len(predicted) == 100
    assert len(set(expected)) >= 2, "a constant prediction would make the comparison meaningless"
    assert predicted == expected
