"""On the board: turn the server's end-of-run export order into a verified bundle and a report.

TensorRT engines only run on the GPU and TensorRT version that built them, so the board builds its
own: ONNX always, a TensorRT engine too when `[export] format = "tensorrt"` and tensorrt with a CUDA
GPU are present. When TensorRT is missing (or its build fails) the board still ships the ONNX bundle
and the report says why the engine was skipped. Nothing here raises: a failed export is a report with
`status = "failed"` and the error, so the agent keeps serving.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from nestling.data import load_dataset
from nestling.edge.agent_config import DataSection
from nestling.edge.export_settings import ExportSection
from nestling.errors import DependencyError, NestlingError, SpecError
from nestling.eval_target import EvalTarget
from nestling.export.bundle import MANIFEST_NAME, read_bundle
from nestling.export.options import ExportData, ExportOptions, load_export_data
from nestling.export.tensorrt_build import TensorRTConfig, require_tensorrt
from nestling.hashing import sha256_file
from nestling.spec import SubmodelSpec
from nestling.wire.codec import check_finite
from nestling.wire.export_messages import ExportOrder, ExportReport, cut

log = logging.getLogger("nestling.agent.export")

MODEL_NAMES = {"fp32": "onnx", "int8": "int8"}  # bundle.json's model keys → the report's names


def order_target(order: ExportOrder) -> EvalTarget:
    """The order as the EvalTarget the export pipeline takes; SpecError if its spec or weights are unusable."""
    spec = SubmodelSpec.from_dict(order.spec)
    check_finite(order.weights)
    return EvalTarget(
        order.name,
        spec,
        order.weights,
        ensemble=order.ensemble,
        static_bn=order.static_bn,
        active_width=order.active_width,
    )


def export_data(settings: ExportSection, section: DataSection) -> ExportData | None:
    """Calibration and held-out images from the board's [data] dataset (same seed as training), or None."""
    if settings.calib_data == "none":
        return None
    extra: dict[str, Any] = {} if section.limit_train is None else {"limit_train": section.limit_train}
    bundle = load_dataset(section.dataset, section.root, seed=section.seed, **extra)
    return load_export_data(
        bundle, calib_samples=settings.calib_samples, eval_samples=settings.eval_samples, seed=section.seed
    )


def tensorrt_plan(settings: ExportSection) -> tuple[str, dict[str, Any]]:
    """(format to build, the report's tensorrt entry): TensorRT only when asked for and usable here."""
    info: dict[str, Any] = {"requested": settings.format == "tensorrt", "built": False, "reason": None}
    if settings.format != "tensorrt":
        return "onnx", info
    info["precision"] = settings.precision
    try:
        require_tensorrt()
    except DependencyError as exc:
        info["reason"] = f"TensorRT skipped, ONNX only: {exc}"
        return "onnx", info
    return "tensorrt", info


def replace_folder(built: Path, out: Path) -> None:
    """Put the finished bundle at `out`, replacing the previous run's only once the new one is complete."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(built, out)
    shutil.rmtree(old, ignore_errors=True)


def _worst(inputs: dict[str, Any]) -> dict[str, Any]:
    reports = [r for r in inputs.values() if isinstance(r, dict)]
    return {
        "max_abs": max(r["max_abs"] for r in reports),
        "max_rel": max(r["max_rel"] for r in reports),
        "top1_agreement": min(r["top1_agreement"] for r in reports),
    }


def _latency(table: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for batch, runtimes in (table or {}).items():
        if isinstance(runtimes, dict):
            out[batch] = {
                name: {"p50_ms": row["p50_ms"], "p90_ms": row["p90_ms"]}
                for name, row in runtimes.items()
                if isinstance(row, dict) and "p50_ms" in row
            }
    return out


def bundle_report(
    order: ExportOrder, folder: Path, tensorrt: dict[str, Any], seconds: float, device_id: str
) -> ExportReport:
    """The report of a finished bundle, read back from its (sha256-verified) bundle.json."""
    manifest = read_bundle(folder)
    models = [MODEL_NAMES[k] for k in manifest["models"] if k in MODEL_NAMES]
    if manifest.get("tensorrt"):
        models.append("tensorrt")
        tensorrt = {**tensorrt, "built": True}
    files = {**manifest["files"], MANIFEST_NAME: sha256_file(folder / MANIFEST_NAME)}
    accuracy = {
        k: v
        for k, v in (manifest.get("accuracy") or {}).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return ExportReport(
        device_id=device_id,
        order_id=order.order_id,
        spec_id=manifest["spec_id"],
        status="ok",
        submodel=order.name,
        models=models,
        bundle=str(folder.resolve()),
        files=files,
        parity={name: _worst(inputs) for name, inputs in manifest["parity"].items()},
        latency_ms=_latency(manifest.get("latency_ms")),
        accuracy=accuracy,
        tensorrt=tensorrt,
        seconds=round(seconds, 3),
    )


def _spec_id(order: ExportOrder) -> str:
    try:
        return order.spec_id
    except (NestlingError, KeyError, TypeError, ValueError, AttributeError):  # a spec the board cannot read
        return "invalid-spec"


def export_on_board(
    order: ExportOrder,
    settings: ExportSection,
    *,
    fleet: str,
    device_id: str,
    data: DataSection,
    threads: int = 1,
) -> ExportReport:
    """Build the bundle of `order` into settings.bundle_dir(...) and report it; never raises."""
    started = time.perf_counter()
    try:
        target = order_target(order)
        images = export_data(settings, data)
        fmt, tensorrt = tensorrt_plan(settings)
        out = settings.bundle_dir(fleet, device_id)
        out.parent.mkdir(parents=True, exist_ok=True)
        source = {
            "fleet": fleet,
            "device": device_id,
            "method": order.method,
            "round": order.round,
            "order": order.order_id,
        }

        def build(fmt: str) -> Path:
            options = ExportOptions(
                format=fmt,
                quantize=None if settings.quantize == "none" else settings.quantize,
                calib_samples=settings.calib_samples,
                eval_samples=settings.eval_samples,
                threads=threads,
                tensorrt=TensorRTConfig(precision=settings.precision),
            )
            building = out.with_name(f".{out.name}.building-{os.getpid()}")
            shutil.rmtree(building, ignore_errors=True)
            try:
                from nestling.export.pipeline import (
                    export_target,  # torch + onnx: imported when a board exports
                )

                export_target(target, building, data=images, options=options, source=source)
            except BaseException:
                shutil.rmtree(building, ignore_errors=True)
                raise
            replace_folder(building, out)
            return out

        try:
            folder = build(fmt)
        except (NestlingError, RuntimeError) as exc:
            if fmt != "tensorrt":
                raise
            log.warning("TensorRT build failed (%s): exporting ONNX only", exc)
            tensorrt["reason"] = cut(f"TensorRT build failed, ONNX only: {type(exc).__name__}: {exc}")
            folder = build("onnx")
        report = bundle_report(order, folder, tensorrt, time.perf_counter() - started, device_id)
        if report.spec_id != target.spec.id:
            raise SpecError(f"bundle holds spec {report.spec_id}, the order asked for {target.spec.id}")
        return report
    except (
        Exception
    ) as exc:  # a bad order, missing data, a parity failure, a full disk: report it, keep running
        log.exception("export of %s failed", order.name)
        return ExportReport(
            device_id=device_id,
            order_id=order.order_id,
            spec_id=_spec_id(order),
            status="failed",
            submodel=order.name,
            error=cut(f"{type(exc).__name__}: {exc}"),
            seconds=round(time.perf_counter() - started, 3),
        )
