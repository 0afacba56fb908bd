"""TensorRT up to the GPU: config validation, profile shapes, trtexec command, calibration batches, errors."""

from __future__ import annotations

import builtins
import sys
from pathlib import Path

import numpy as np
import pytest

from nestling.errors import ConfigError, DataError, DependencyError
from nestling.export import tensorrt_build
from nestling.export.calibration import CalibrationBatches
from nestling.export.cli import export_main
from nestling.export.pipeline import ExportOptions, export_submodel
from nestling.export.tensorrt_build import TENSORRT_HINT, TensorRTConfig, require_tensorrt, trtexec_command


def test_config_validates_precision_batches_and_builder() -> None:
    with pytest.raises(ConfigError, match="precision 'int4'"):
        TensorRTConfig(precision="int4")
    with pytest.raises(ConfigError, match="min <= opt <= max"):
        TensorRTConfig(min_batch=4, opt_batch=2, max_batch=8)
    with pytest.raises(ConfigError, match="builder"):
        TensorRTConfig(builder="polygraphy")
    assert TensorRTConfig(opt_batch=8, max_batch=64).profile_shapes((3, 32, 32)) == (
        (1, 3, 32, 32),
        (8, 3, 32, 32),
        (64, 3, 32, 32),
    )


def test_trtexec_command_builds_the_same_engine_as_the_api(tmp_path: Path) -> None:
    command = trtexec_command(
        tmp_path / "m.onnx",
        tmp_path / "m.plan",
        TensorRTConfig(precision="int8", workspace_mb=512),
        "input",
        (3, 32, 32),
    )
    assert command[0] == "trtexec" and f"--onnx={tmp_path / 'm.onnx'}" in command
    assert "--minShapes=input:1x3x32x32" in command and "--maxShapes=input:32x3x32x32" in command
    assert "--int8" in command and "--fp16" not in command and "--memPoolSize=workspace:512M" in command
    assert "--fp16" in trtexec_command(tmp_path / "a", tmp_path / "b", TensorRTConfig(), "input", (1, 8, 8))
    assert not {"--fp16", "--int8"} & set(
        trtexec_command(tmp_path / "a", tmp_path / "b", TensorRTConfig(precision="fp32"), "input", (1, 8, 8))
    )


def test_trtexec_is_used_only_on_a_jetson_with_it_on_the_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    release = tmp_path / "nv_tegra_release"
    monkeypatch.setattr(tensorrt_build, "JETSON_RELEASE_FILE", release)
    monkeypatch.setattr(tensorrt_build.shutil, "which", lambda name: "/usr/src/tensorrt/bin/trtexec")
    assert not TensorRTConfig().use_trtexec()
    release.write_text("# R36 (release)")
    assert TensorRTConfig().use_trtexec() and not TensorRTConfig(builder="api").use_trtexec()


def test_calibration_batches_are_fixed_size_and_reiterable() -> None:
    x = np.random.default_rng(0).standard_normal((70, 3, 8, 8)).astype(np.float64)
    batches = CalibrationBatches(x, batch_size=32)
    first, second = list(batches), list(batches)
    assert len(batches) == 2 and batches.samples == 64 and batches.shape == (32, 3, 8, 8)
    assert all(b.shape == (32, 3, 8, 8) and b.dtype == np.float32 and b.flags.c_contiguous for b in first)
    np.testing.assert_array_equal(first[1], second[1])
    assert len(CalibrationBatches(x, batch_size=8, limit=20)) == 2
    with pytest.raises(DataError, match="one full batch"):
        CalibrationBatches(x[:4], batch_size=8)
    with pytest.raises(DataError, match="NaN"):
        CalibrationBatches(np.full((8, 3, 2, 2), np.nan), batch_size=8)


def test_missing_tensorrt_raises_the_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_tensorrt(name: str, *args, **kwargs):
        if name == "tensorrt":
            raise ImportError("No module named 'tensorrt'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_tensorrt)
    with pytest.raises(DependencyError) as info:
        require_tensorrt()
    assert str(info.value) == TENSORRT_HINT
    assert "pip install nestling[tensorrt]" in TENSORRT_HINT and "NVIDIA GPU" in TENSORRT_HINT


def test_tensorrt_without_a_gpu_is_refused_too(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = type(sys)("tensorrt")
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    monkeypatch.setattr(tensorrt_build, "_cuda_available", lambda: False)
    with pytest.raises(DependencyError, match="NVIDIA GPU"):
        require_tensorrt()
    monkeypatch.setattr(tensorrt_build, "_cuda_available", lambda: True)
    assert require_tensorrt() is fake


@pytest.mark.skipif(tensorrt_build._cuda_available(), reason="this machine has a CUDA GPU")
def test_export_command_fails_fast_with_one_line_on_this_cpu_machine(
    nefl_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = export_main(
        [
            "--checkpoint",
            str(nefl_checkpoint),
            "--submodel",
            "k1",
            "--format",
            "tensorrt",
            "--out",
            str(tmp_path / "b"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"error: DependencyError: {TENSORRT_HINT}"
    assert not (tmp_path / "b").exists()
    with pytest.raises(DependencyError):
        export_submodel(
            nefl_checkpoint, tmp_path / "c", submodel="k1", options=ExportOptions(format="tensorrt")
        )
