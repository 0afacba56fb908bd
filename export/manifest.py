"""The body of bundle.json: what a board needs to run the model, and what was measured when it was made."""

from __future__ import annotations

import datetime as _dt
from typing import Any

import nestling
from nestling.eval_target import EvalTarget
from nestling.export.onnx_export import INPUT_NAME, OnnxResult
from nestling.export.options import ExportData, ExportOptions
from nestling.export.standalone import OutputPlan


def _outputs(plan: OutputPlan) -> list[dict[str, Any]]:
    if plan.combine == "mean":
        return [{"name": plan.names[0], "taps": list(plan.taps), "combine": "mean"}]
    return [{"name": name, "taps": [tap], "combine": "none"} for name, tap in zip(plan.names, plan.taps)]


def bundle_manifest(
    target: EvalTarget,
    plan: OutputPlan,
    onnx_result: OnnxResult,
    data: ExportData | None,
    options: ExportOptions,
    measured: dict[str, Any],
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """bundle.json without its `files` and `format` (added by `export.bundle.write_bundle`).

    `measured` holds models, tensorrt, parity, latency_ms and accuracy as the pipeline produced them.
    """
    model = target.spec.model
    normalization = None
    if data is not None:
        normalization = {"mean": list(data.mean), "std": list(data.std), "pixel_scale": 255.0}
    calibrated = target.static_bn or model.norm_stats == "batch"
    single = plan.taps[0] if len(plan.taps) == 1 else "ensemble"
    return {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "nestling_version": nestling.__version__,
        "source": {**(source or {}), "submodel": target.name},
        "spec": target.spec.to_dict(),
        "spec_id": target.spec.id,
        "input": {
            "name": INPUT_NAME,
            "shape": ["batch", model.in_channels, model.image_size, model.image_size],
            "dtype": "float32",
            "layout": "NCHW",
            "normalization": normalization,
        },
        "class_names": (data.class_names if data is not None and data.class_names else None)
        or [str(k) for k in range(model.num_classes)],
        "outputs": _outputs(plan),
        "default_output": plan.names[-1],
        "exit": "all" if options.all_exits else single,
        "batch_statistics": "static BN calibrated on the training split" if calibrated else "running",
        "opset": onnx_result.opset,
        "onnx": {
            "exporter": onnx_result.exporter,
            "simplified": onnx_result.simplified,
            "nodes": onnx_result.nodes,
        },
        "models": measured["models"],
        "default_model": "int8" if "int8" in measured["models"] else "fp32",
        "tensorrt": measured.get("tensorrt"),
        "parity": measured["parity"],
        "latency_ms": measured.get("latency_ms"),
        "accuracy": measured.get("accuracy") or None,
    }
