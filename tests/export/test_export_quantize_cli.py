"""Static int8 bundles, and `nestling export` on a checkpoint written by a real (one-round) simulation."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from nestling.config import config_from_dict
from nestling.errors import ConfigError
from nestling.export.bundle import read_bundle
from nestling.export.cli import export_main
from nestling.export.pipeline import ExportData, ExportOptions, export_submodel
from nestling.export.quantize import Int8Options
from nestling.simulator.run import run_simulation
from nestling.spec import SubmodelSpec


@pytest.fixture(scope="module")
def simulated_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One NeFL-WD round on the synthetic set through the coordinator (which writes the manifest)."""
    out = tmp_path_factory.mktemp("run")
    cfg = config_from_dict(
        {
            "run": {"rounds": 1, "workers": 1, "eval_every": 1},
            "data": {"dataset": "synthetic", "clients": 5},
            "model": {"arch": "resnet20"},
            "method": {"name": "nefl-wd"},
            "train": {"fraction": 1.0, "local_steps": 2, "batch_size": 16},
        }
    )
    run_simulation(cfg, out)
    return out


def test_int8_bundle_is_qdq_calibrated_and_scored_on_held_out_images(
    nefl_checkpoint: Path, synthetic32: ExportData, tmp_path: Path
) -> None:
    options = ExportOptions(quantize="int8", benchmark=False, parity_samples=32)
    manifest = export_submodel(nefl_checkpoint, tmp_path, submodel="k5", data=synthetic32, options=options)
    assert manifest["default_model"] == "int8" and set(read_bundle(tmp_path)["files"]) == {
        "model.onnx",
        "model.int8.onnx",
    }
    quantization = manifest["models"]["int8"]["quantization"]
    assert quantization["format"] == "QDQ" and quantization["calibration_split"] == "train"
    assert quantization["calibration_samples"] == 256
    ops = {n.op_type for n in onnx.load(str(tmp_path / "model.int8.onnx")).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    accuracy = manifest["accuracy"]
    assert accuracy["int8_drop_points"] == pytest.approx(
        100 * (accuracy["onnx_fp32"] - accuracy["onnx_int8"])
    )
    assert manifest["parity"]["onnx_int8"]["real"]["top1_agreement"] >= 0.8


def test_symmetric_int8_for_tensorrt_has_zero_points_at_zero(
    nefl_checkpoint: Path, synthetic32: ExportData, tmp_path: Path
) -> None:
    options = ExportOptions(
        quantize="int8", benchmark=False, parity_samples=8, int8=Int8Options(symmetric=True)
    )
    export_submodel(nefl_checkpoint, tmp_path, submodel="k1", data=synthetic32, options=options)
    proto = onnx.load(str(tmp_path / "model.int8.onnx"))
    zero_points = [
        onnx.numpy_helper.to_array(t) for t in proto.graph.initializer if t.name.endswith("zero_point")
    ]
    assert zero_points and all((z == 0).all() and z.dtype.kind == "i" for z in zero_points)


def test_int8_without_data_is_refused(nefl_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="calib-data"):
        export_submodel(nefl_checkpoint, tmp_path, submodel="k1", options=ExportOptions(quantize="int8"))


def test_cli_lists_and_exports_a_simulated_checkpoint(
    simulated_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert export_main(["--checkpoint", str(simulated_run), "--list"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in listing] == ["k1", "k2", "k3", "k4", "k5"]
    code = export_main(
        [
            "--checkpoint",
            str(simulated_run / "checkpoints"),
            "--submodel",
            "k2",
            "--no-benchmark",
            "--eval-samples",
            "100",
            "--out",
            str(tmp_path / "k2"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert "parity onnx_fp32: random max_abs=" in capsys.readouterr().out
    manifest = read_bundle(tmp_path / "k2")
    # The checkpoint names its dataset, so the bundle carries its normalisation and real-input parity.
    assert manifest["accuracy"]["dataset"] == "synthetic" and manifest["input"]["normalization"] is not None
    assert manifest["parity"]["onnx_fp32"]["real"]["max_abs"] <= 1e-4


def test_cli_exports_an_explicit_spec_and_reports_bad_choices(
    simulated_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = json.loads(next((simulated_run / "checkpoints").glob("round-*/manifest.json")).read_text())
    from nestling.models import ModelConfig

    spec = SubmodelSpec(ModelConfig.from_dict(manifest["model"]), width=0.5, blocks=(0, 3, 6))
    (tmp_path / "spec.json").write_text(spec.to_json())
    code = export_main(
        [
            "--checkpoint",
            str(simulated_run),
            "--spec",
            str(tmp_path / "spec.json"),
            "--calib-data",
            "none",
            "--no-benchmark",
            "--out",
            str(tmp_path / "spec"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert read_bundle(tmp_path / "spec")["spec_id"] == spec.id
    assert (
        export_main(["--checkpoint", str(simulated_run), "--submodel", "k9", "--out", str(tmp_path / "x")])
        == 2
    )
    assert "has no submodel 'k9' (known: k1" in capsys.readouterr().err
    assert export_main(["--checkpoint", str(tmp_path), "--level", "1", "--out", str(tmp_path / "y")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
