"""Every NeFL-WD submodel and every ScaleFL level of a CIFAR-sized ResNet-20 exports with parity ≤ 1e-4."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

from nestling.export.bundle import read_bundle
from nestling.export.onnx_export import INPUT_NAME
from nestling.export.ort_bench import ort_runner, ort_session
from nestling.export.pipeline import ExportData, ExportOptions, export_submodel
from nestling.export.source import open_checkpoint
from nestling.server.strategies import Strategy, StrategyContext, create_strategy

FAST = ExportOptions(benchmark=False, parity_samples=32)


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "k4", "k5"])
def test_every_nefl_wd_submodel_exports_with_parity(
    nefl_checkpoint: Path, cifar_data: ExportData, tmp_path: Path, name: str
) -> None:
    manifest = export_submodel(nefl_checkpoint, tmp_path, submodel=name, data=cifar_data, options=FAST)
    parity = manifest["parity"]["onnx_fp32"]
    assert parity["random"]["max_abs"] <= 1e-4 and parity["real"]["max_abs"] <= 1e-4
    assert parity["real"]["top1_agreement"] == 1.0
    assert manifest["accuracy"]["pytorch"] == manifest["accuracy"]["onnx_fp32"]
    assert read_bundle(tmp_path)["files"].keys() == {"model.onnx"}


def test_nefl_submodels_are_physically_smaller_and_drop_skipped_blocks(
    nefl_checkpoint: Path, tmp_path: Path
) -> None:
    sizes, convs = [], []
    targets = open_checkpoint(nefl_checkpoint).targets()
    for target in (targets[0], targets[-1]):
        options = ExportOptions(benchmark=False, parity_samples=8, align_channels=1)  # the slices as they are
        export_submodel(nefl_checkpoint, tmp_path / target.name, submodel=target.name, options=options)
        proto = onnx.load(str(tmp_path / target.name / "model.onnx"))
        sizes.append(sum(int(np.prod(t.dims)) for t in proto.graph.initializer))
        convs.append(sum(1 for n in proto.graph.node if n.op_type == "Conv"))
        # BN folded into convolutions: no normalisation node is left in a post-activation ResNet.
        assert not [n for n in proto.graph.node if n.op_type in ("BatchNormalization", "Mul", "Div")]
    assert sizes[0] < 0.5 * sizes[1]
    # k1 keeps 2 of 3 blocks per stage: 6 blocks × 2 convs + 2 projections + stem, against 9 × 2 + 2 + 1.
    assert convs == [15, 21]


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_every_scalefl_level_exports_with_parity(
    scalefl_checkpoint: Path, synthetic32: ExportData, tmp_path: Path, level: int
) -> None:
    manifest = export_submodel(scalefl_checkpoint, tmp_path, level=level, data=synthetic32, options=FAST)
    parity = manifest["parity"]["onnx_fp32"]
    assert parity["random"]["max_abs"] <= 1e-4 and parity["real"]["max_abs"] <= 1e-4
    assert manifest["batch_statistics"].startswith("static BN")
    assert manifest["exit"] == ("head" if level == 4 else f"exit{manifest['spec']['exits'][-1]}")


def test_scalefl_all_exits_are_graph_outputs_in_depth_order(
    scalefl_checkpoint: Path, synthetic32: ExportData, tmp_path: Path
) -> None:
    options = ExportOptions(benchmark=False, parity_samples=16, all_exits=True)
    manifest = export_submodel(scalefl_checkpoint, tmp_path, submodel="L4", data=synthetic32, options=options)
    names = [o["name"] for o in manifest["outputs"]]
    assert names == [f"exit{e}" for e in manifest["spec"]["exits"]] + ["head"]
    assert manifest["default_output"] == "head"
    assert manifest["parity"]["onnx_fp32"]["real"]["max_abs"] <= 1e-4
    session = ort_session(tmp_path / "model.onnx")
    assert [o.name for o in session.get_outputs()] == names


def test_early_exit_export_drops_the_blocks_after_it(
    scalefl_checkpoint: Path, synthetic32: ExportData, tmp_path: Path
) -> None:
    first_exit = open_checkpoint(scalefl_checkpoint).model.exit_points[0]
    full = export_submodel(
        scalefl_checkpoint, tmp_path / "full", submodel="L4", data=synthetic32, options=FAST
    )
    early = export_submodel(
        scalefl_checkpoint,
        tmp_path / "early",
        submodel="L4",
        data=synthetic32,
        options=ExportOptions(benchmark=False, parity_samples=16, exit=str(first_exit)),
    )
    assert early["exit"] == f"exit{first_exit}" and full["exit"] == "head"
    assert (tmp_path / "early" / "model.onnx").stat().st_size < 0.5 * (
        tmp_path / "full" / "model.onnx"
    ).stat().st_size
    assert early["parity"]["onnx_fp32"]["real"]["max_abs"] <= 1e-4


def test_exported_graph_has_a_dynamic_batch_axis(nefl_checkpoint: Path, tmp_path: Path) -> None:
    export_submodel(nefl_checkpoint, tmp_path, submodel="k2", options=FAST)
    run = ort_runner(ort_session(tmp_path / "model.onnx"))
    x = np.random.default_rng(0).standard_normal((5, 3, 32, 32), dtype=np.float32)
    together = run(x)[0]
    one_by_one = np.concatenate([run(x[i : i + 1])[0] for i in range(5)])
    assert together.shape == (5, 10)
    np.testing.assert_allclose(together, one_by_one, atol=1e-5)
    assert onnx.load(str(tmp_path / "model.onnx")).graph.input[0].name == INPUT_NAME


@pytest.mark.parametrize("method", ["heterofl", "fjord", "depthfl", "fedavg"])
def test_other_methods_export_their_smallest_and_largest_submodel(
    method: str, synthetic32: ExportData, tmp_path: Path, write_checkpoint: Callable[[Strategy, Path], Path]
) -> None:
    ctx = StrategyContext(
        arch="resnet20",
        num_classes=10,
        in_channels=3,
        image_size=32,
        num_clients=10,
        total_rounds=1,
        dataset="synthetic",
    )
    checkpoint = write_checkpoint(create_strategy(method, ctx), tmp_path / "checkpoints")
    count = len(open_checkpoint(checkpoint).targets())
    for level in sorted({1, count}):
        manifest = export_submodel(
            checkpoint, tmp_path / str(level), level=level, data=synthetic32, options=FAST
        )
        assert manifest["parity"]["onnx_fp32"]["real"]["max_abs"] <= 1e-4, manifest["parity"]
    if (
        method == "depthfl"
    ):  # DepthFL predicts with the mean of its classifiers: one graph output computing it
        assert manifest["exit"] == "ensemble" and len(manifest["outputs"][0]["taps"]) == 3
