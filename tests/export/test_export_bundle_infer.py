"""Bundles: what bundle.json records, sha256 refusal, and `infer` on images and arrays (in this process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nestling.errors import DataError
from nestling.export.bundle import read_bundle
from nestling.export.infer import BundleRunner, infer_main
from nestling.export.pipeline import ExportData, ExportOptions, export_submodel
from nestling.export.reference import reference_model
from nestling.export.source import open_checkpoint, select_target

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bundle(nefl_checkpoint: Path, cifar_data: ExportData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundle")
    export_submodel(
        nefl_checkpoint,
        out,
        submodel="k3",
        data=cifar_data,
        options=ExportOptions(bench_rounds=2, bench_per_round=5, parity_samples=16),
    )
    return out


def test_bundle_json_records_the_deployment_contract(bundle: Path) -> None:
    manifest = read_bundle(bundle)
    assert manifest["input"]["shape"] == ["batch", 3, 32, 32]
    assert manifest["input"]["normalization"]["mean"] == pytest.approx([0.4914, 0.4822, 0.4465])
    assert manifest["class_names"][0] == "airplane" and manifest["exit"] == "head"
    assert manifest["opset"] == 17 and manifest["source"]["method"] == "nefl-wd"
    assert manifest["onnx"]["channel_alignment"] == 8
    assert manifest["spec"]["width"] < 1.0 and manifest["spec_id"]
    assert set(manifest["parity"]["onnx_fp32"]) == {"random", "real"}
    for batch in ("batch_1", "batch_32"):
        row = manifest["latency_ms"][batch]
        assert row["onnxruntime"]["p90_ms"] >= row["onnxruntime"]["p50_ms"] > 0
        assert row["pytorch_eager"]["p50_ms"] > 0 and row["speedup_p50"]["onnxruntime"] > 0
    assert manifest["accuracy"]["samples"] == 100


def test_a_tampered_bundle_is_refused(bundle: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in bundle.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    model = bytearray((copy / "model.onnx").read_bytes())
    model[-10] ^= 0xFF
    (copy / "model.onnx").write_bytes(bytes(model))
    with pytest.raises(DataError, match="does not match its sha256"):
        read_bundle(copy)
    assert infer_main(["--bundle", str(copy), str(tmp_path / "any.npy")]) == 2
    (copy / "model.onnx").unlink()
    with pytest.raises(DataError, match="missing"):
        read_bundle(copy)


def test_infer_on_png_images_matches_pytorch_top1(
    bundle: Path,
    nefl_checkpoint: Path,
    cifar_data: ExportData,
    cifar100_images: tuple[np.ndarray, np.ndarray],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from PIL import Image

    pixels = cifar100_images[0][:8]
    paths = []
    for i, image in enumerate(pixels):
        paths.append(tmp_path / f"img{i}.png")
        Image.fromarray(image).save(paths[-1])
    assert infer_main(["--bundle", str(bundle), "--json", *map(str, paths)]) == 0
    predicted = [p["index"] for p in json.loads(capsys.readouterr().out)]
    target = select_target(open_checkpoint(nefl_checkpoint), submodel="k3")
    net = reference_model(target)
    with torch.no_grad():
        expected = net(cifar_data.heldout_x[:8]).argmax(1).tolist()
    assert predicted == expected


def test_infer_reads_uint8_and_float_arrays_alike(
    bundle: Path, cifar_data: ExportData, cifar100_images: tuple[np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    runner = BundleRunner(bundle)
    np.save(tmp_path / "pixels.npy", cifar100_images[0][:4])
    np.save(tmp_path / "floats.npy", cifar_data.heldout_x[:4].numpy())
    from_pixels = runner.run(runner.load(tmp_path / "pixels.npy"))
    from_floats = runner.run(runner.load(tmp_path / "floats.npy"))
    np.testing.assert_allclose(from_pixels, from_floats, atol=1e-4)
    np.save(tmp_path / "wrong.npy", np.zeros((1, 3, 16, 16), np.float32))
    with pytest.raises(DataError, match="does not match the bundle"):
        runner.run(runner.load(tmp_path / "wrong.npy"))


def test_infer_never_imports_torch(bundle: Path, cifar_data: ExportData, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", cifar_data.heldout_x[:2].numpy())
    code = (
        "import sys; from export.infer import infer_main; rc = infer_main(sys.argv[1:]); "
        "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')], 'torch imported'; "
        "sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "--bundle", str(bundle), str(tmp_path / "x.npy")],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip().splitlines()) == 2
