"""`export_submodel`: checkpoint + submodel → verified bundle (fold, ONNX, parity, latency, int8, TRT)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nestling.data import DatasetBundle
from nestling.errors import ConfigError, DataError, SpecError
from nestling.eval_target import EvalTarget
from nestling.export.align import align_channels, alignable
from nestling.export.bundle import write_bundle
from nestling.export.calibration import CalibrationBatches
from nestling.export.manifest import bundle_manifest
from nestling.export.onnx_export import INPUT_NAME, export_onnx
from nestling.export.options import ExportData, ExportOptions, load_export_data
from nestling.export.ort_bench import latency_table, ort_runner, ort_session
from nestling.export.parity import Runner, accuracy, batched, compare
from nestling.export.quantize import Int8Options, quantize_int8
from nestling.export.reference import reference_model
from nestling.export.source import open_checkpoint, select_target
from nestling.export.standalone import OutputPlan, build_standalone, plan_outputs, reference_outputs
from nestling.export.tensorrt_build import EngineRunner, build_engine, require_tensorrt
from nestling.models.net import ScalableNet
from nestling.spec import SubmodelSpec

__all__ = ["ExportData", "ExportOptions", "export_submodel", "export_target", "load_export_data"]


@dataclass
class _Run:
    """One export in progress: its PyTorch reference, the data it checks against, and what it has measured."""

    out: Path
    shape: tuple[int, int, int]
    reference: Runner
    data: ExportData | None
    options: ExportOptions
    files: list[str] = field(default_factory=list)
    models: dict[str, Any] = field(default_factory=dict)
    runners: dict[str, Runner] = field(default_factory=dict)
    parity: dict[str, Any] = field(default_factory=dict)
    accuracy: dict[str, Any] = field(default_factory=dict)
    tensorrt: dict[str, Any] | None = None

    def check(self, name: str, run: Runner) -> None:
        """Parity against the reference on random and real inputs, and accuracy on the held-out images."""
        rng = np.random.default_rng(self.options.seed)
        random_x = rng.standard_normal((self.options.parity_samples, *self.shape), dtype=np.float32)
        report = {
            "random": compare(batched(run, random_x), batched(self.reference, random_x), "random").to_dict()
        }
        if self.data is not None and len(self.data.heldout_y):
            real_x = self.data.heldout_x[: self.options.parity_samples].numpy()
            report["real"] = compare(
                batched(run, real_x), batched(self.reference, real_x), self.data.name
            ).to_dict()
            self.accuracy[name] = accuracy(run, self.data.heldout_x.numpy(), self.data.heldout_y.numpy())
        self.parity[name] = report
        self.runners[name] = run


def _input_shape(spec: SubmodelSpec) -> tuple[int, int, int]:
    return (spec.model.in_channels, spec.model.image_size, spec.model.image_size)


def _check_data(data: ExportData, spec: SubmodelSpec) -> None:
    shape = tuple(data.heldout_x.shape[1:]) or tuple(data.calibration.shape[1:])
    if shape != _input_shape(spec):
        raise DataError(f"dataset {data.name} has inputs {shape}, the model takes {_input_shape(spec)}")
    if data.heldout_y.numel() and int(data.heldout_y.max()) >= spec.model.num_classes:
        raise DataError(f"dataset {data.name} has more classes than the model's {spec.model.num_classes}")


def _reference_runner(net: ScalableNet, plan: OutputPlan) -> Runner:
    def run(x: np.ndarray) -> list[np.ndarray]:
        with torch.inference_mode():
            return [t.numpy() for t in reference_outputs(net, plan, torch.from_numpy(x))]

    return run


def _calibration(data: ExportData | None) -> CalibrationBatches | None:
    if data is None:
        return None
    return CalibrationBatches(data.calibration.numpy(), batch_size=min(32, len(data.calibration)))


def _add_fp32(run: _Run, onnx_path: Path, name: str) -> None:
    run.check("onnx_fp32", ort_runner(ort_session(onnx_path, run.options.threads)))
    worst = max(r["max_rel"] for r in run.parity["onnx_fp32"].values())
    if worst > run.options.parity_tolerance:
        raise SpecError(
            f"exported graph of {name} differs from PyTorch by {worst:.2e} (relative), above the tolerance "
            f"{run.options.parity_tolerance:.0e}: {run.parity['onnx_fp32']}"
        )
    run.files.append(onnx_path.name)
    run.models["fp32"] = {"file": onnx_path.name, "runtime": "onnxruntime"}


def _add_int8(run: _Run, onnx_path: Path, calibration: CalibrationBatches) -> None:
    path = quantize_int8(onnx_path, run.out / "model.int8.onnx", calibration, run.options.int8)
    run.check("onnx_int8", ort_runner(ort_session(path, run.options.threads)))
    run.files.append(path.name)
    quantization = {**run.options.int8.describe(), "calibration_samples": calibration.samples}
    run.models["int8"] = {
        "file": path.name,
        "runtime": "onnxruntime",
        "quantization": {**quantization, "calibration_split": "train"},
    }
    if "onnx_fp32" in run.accuracy:
        run.accuracy["int8_drop_points"] = 100.0 * (run.accuracy["onnx_fp32"] - run.accuracy["onnx_int8"])


def _add_tensorrt(run: _Run, onnx_path: Path, calibration: CalibrationBatches | None) -> None:
    config = run.options.tensorrt
    plan = run.out / "model.plan"
    info: dict[str, Any] = {
        "file": plan.name,
        "precision": config.precision,
        "builder": "trtexec" if config.use_trtexec() else "python-api",
    }
    if config.precision == "int8":
        if calibration is None:
            raise ConfigError("a TensorRT int8 engine needs calibration images: pass --calib-data DATASET")
        symmetric = Int8Options(run.options.int8.method, per_channel=True, symmetric=True)
        with tempfile.TemporaryDirectory(prefix="nestling-trt-") as tmp:
            qdq = quantize_int8(onnx_path, Path(tmp) / "model.qdq.onnx", calibration, symmetric)
            build_engine(qdq, plan, config, INPUT_NAME, run.shape)
        info.update(
            quantization="explicit QDQ (symmetric), calibrated like the ONNX int8 model",
            calibration_samples=calibration.samples,
        )
    else:
        build_engine(onnx_path, plan, config, INPUT_NAME, run.shape)
    run.check("tensorrt", EngineRunner(plan))
    run.files.append(plan.name)
    run.tensorrt = info


def export_target(
    target: EvalTarget,
    out: Path,
    *,
    data: ExportData | None = None,
    options: ExportOptions | None = None,
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Export one submodel (an EvalTarget: spec + its own weights) into the bundle folder `out`.

    Returns the bundle manifest (also written to out/bundle.json). Raises SpecError when the exported
    graph does not reproduce the PyTorch submodel within `options.parity_tolerance`.
    """
    options = options or ExportOptions()
    if options.format == "tensorrt":
        require_tensorrt()  # fail in the first second, not after the ONNX work
    if data is not None:
        _check_data(data, target.spec)
    if options.quantize and data is None:
        raise ConfigError(
            "int8 quantization needs real calibration and held-out images: pass --calib-data DATASET"
        )
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(options.seed)
    shape = _input_shape(target.spec)

    net = reference_model(target, data.calibration if data is not None else None)
    plan = plan_outputs(net, exit=options.exit, all_exits=options.all_exits, ensemble=target.ensemble)
    standalone = build_standalone(net, plan)
    alignment = options.align_channels if alignable(standalone) else 1
    onnx_result = export_onnx(
        align_channels(standalone, alignment),
        out / "model.onnx",
        shape,
        opset=options.opset,
        simplify=options.simplify,
        dynamo=options.dynamo,
    )
    run = _Run(out, shape, _reference_runner(net, plan), data, options)
    if data is not None and len(data.heldout_y):
        run.accuracy = {
            "dataset": data.name,
            "split": "test",
            "samples": len(data.heldout_y),
            "pytorch": accuracy(run.reference, data.heldout_x.numpy(), data.heldout_y.numpy()),
        }
    run.runners["pytorch_eager"] = run.reference  # the baseline every latency ratio divides
    _add_fp32(run, onnx_result.path, target.name)
    calibration = _calibration(data)
    if options.quantize == "int8":
        assert calibration is not None
        _add_int8(run, onnx_result.path, calibration)
    if options.format == "tensorrt":
        _add_tensorrt(run, onnx_result.path, calibration)
    latency = None
    if options.benchmark:
        names = {"onnx_fp32": "onnxruntime", "onnx_int8": "onnxruntime_int8"}
        runners = {names.get(k, k): v for k, v in run.runners.items()}
        latency = latency_table(
            runners,
            shape,
            threads=options.threads,
            rounds=options.bench_rounds,
            per_round=options.bench_per_round,
            seed=options.seed,
        )
    measured = {
        "models": run.models,
        "tensorrt": run.tensorrt,
        "parity": run.parity,
        "latency_ms": latency,
        "accuracy": run.accuracy,
    }
    manifest = bundle_manifest(target, plan, onnx_result, data, options, measured, source)
    manifest["onnx"]["channel_alignment"] = alignment
    write_bundle(out, manifest, run.files)
    return manifest


def export_submodel(
    checkpoint: Path,
    out: Path,
    *,
    submodel: str | None = None,
    level: int | None = None,
    spec: SubmodelSpec | None = None,
    data: ExportData | DatasetBundle | str | None = None,
    data_root: str | Path | None = None,
    options: ExportOptions | None = None,
) -> dict[str, Any]:
    """Export one submodel of a checkpoint (by name or spec id, 1-based level, or explicit spec) as a bundle.

    `data` supplies calibration and held-out images: a dataset name, a loaded DatasetBundle, ready
    ExportData, or None (random-input parity only; no int8, no accuracy, no normalisation in the bundle).
    """
    options = options or ExportOptions()
    source = open_checkpoint(Path(checkpoint))
    target = select_target(source, submodel=submodel, level=level, spec=spec)
    if data is not None and not isinstance(data, ExportData):
        data = load_export_data(
            data,
            data_root,
            calib_samples=options.calib_samples,
            eval_samples=options.eval_samples,
            seed=options.seed,
        )
    info = {"checkpoint": str(source.path), "method": source.method, "round": source.round}
    return export_target(target, Path(out), data=data, options=options, source=info)
