"""The end-of-run export exchange on the wire: the server's export order and the board's export report.

TensorRT engines only run on the GPU and TensorRT version that built them, so a board builds its own
deployable. When a run ends the server sends each board that asked an `export` order on
`devices/<id>/ctrl` (chunked like a task: it holds the final weights of the board's submodel), and the
board answers with one small `export_report` on `devices/<id>/result` (the only topic it may write).
Decoders check every field's type and size and raise WireError naming the first bad one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from nestling.errors import WireError
from nestling.wire.codec import Message, decode_message, encode_message
from nestling.wire.fleet_messages import CONTROL_BYTES, _expect, _json_safe, _require, _short

EXPORT, EXPORT_REPORT = "export", "export_report"
REPORT_STATUSES = ("ok", "failed")
BUNDLE_MODELS = (
    "onnx",
    "int8",
    "tensorrt",
)  # what a bundle can hold: fp32 ONNX, int8 ONNX, a TensorRT engine
MAX_TEXT = 2000  # error text and reasons are cut to this many characters: a report stays a control message
MAX_PATH = 1024
MAX_FILES = 16
MAX_KEYS = 64  # per level of the parity / latency / accuracy tables
_SHA256_HEX = frozenset("0123456789abcdef")


def _flag(meta: dict[str, Any], name: str) -> bool:
    value = meta.get(name)
    if not isinstance(value, bool):
        raise WireError(f"field {name!r} must be true or false, got {value!r:.40}")
    return value


# -- order (server → device) -------------------------------------------------------------------
@dataclass
class ExportOrder:
    """Build a deployable of this submodel: the final weights of the device's submodel, sliced exactly as the
    server evaluates it (NeFL: its own BN and step sizes; FjORD: its width's BN statistics)."""

    device_id: str
    round: int  # the run's last round: the weights are the model after it
    order_id: str
    name: str  # the submodel's name in the run summary (k3, L2, r0.5, p0.6, d2, full)
    spec: dict[str, Any]  # SubmodelSpec.to_dict()
    weights: dict[str, torch.Tensor]
    ensemble: bool = False  # DepthFL: the prediction is the mean of every classifier
    static_bn: bool = False  # HeteroFL sBN: recompute BN statistics on calibration images first
    active_width: float | None = None  # FjORD: run at this width with its BN statistics
    method: str = ""

    @property
    def spec_id(self) -> str:
        from nestling.spec import SubmodelSpec

        return SubmodelSpec.from_dict(self.spec).id


def encode_export_order(order: ExportOrder, session: str) -> bytes:
    meta = {
        "order_id": order.order_id,
        "session": session,
        "name": order.name,
        "spec": order.spec,
        "ensemble": order.ensemble,
        "static_bn": order.static_bn,
        "active_width": order.active_width,
        "method": order.method or "unknown",
    }
    return encode_message(
        EXPORT,
        {"round": order.round, "device_id": order.device_id, "spec_id": order.spec_id, "meta": meta},
        order.weights,
    )


def decode_export_order(message: Message) -> tuple[ExportOrder, str]:
    """(ExportOrder, server session) from a decoded frame; the spec itself is checked when it is built."""
    meta = _expect(message, EXPORT)
    if message.round is None or message.device_id is None or message.spec_id is None:
        raise WireError("an export order names its round, device and spec")
    width = meta.get("active_width")
    if width is not None and (
        isinstance(width, bool) or not isinstance(width, (int, float)) or not 0 < width <= 1
    ):
        raise WireError(f"field 'active_width' must be a number in (0, 1] or null, got {width!r:.40}")
    order = ExportOrder(
        device_id=message.device_id,
        round=message.round,
        order_id=_short(meta, "order_id"),
        name=_short(meta, "name"),
        spec=_require(meta, "spec", dict, "an object"),
        weights=message.tensors,
        ensemble=_flag(meta, "ensemble"),
        static_bn=_flag(meta, "static_bn"),
        active_width=None if width is None else float(width),
        method=_short(meta, "method"),
    )
    return order, _short(meta, "session")


# -- report (device → server) ------------------------------------------------------------------
@dataclass
class ExportReport:
    """What a board built from an export order, or why it could not: the run summary's deployable entry."""

    device_id: str
    order_id: str
    spec_id: str
    status: str  # "ok": a verified bundle is on the board; "failed": see `error`
    submodel: str = ""
    models: list[str] = field(default_factory=list)  # in the bundle: onnx (fp32), int8, tensorrt
    bundle: str | None = None  # the bundle folder on the board
    files: dict[str, str] = field(default_factory=dict)  # file name → sha256 (bundle.json included)
    parity: dict[str, Any] = field(
        default_factory=dict
    )  # model → max_abs, max_rel, top1_agreement (worst case)
    latency_ms: dict[str, Any] = field(default_factory=dict)  # batch_1 / batch_32 → runtime → p50_ms, p90_ms
    accuracy: dict[str, Any] = field(default_factory=dict)  # held-out accuracy per runtime, when measured
    tensorrt: dict[str, Any] = field(
        default_factory=dict
    )  # requested, built, precision, reason it was skipped
    error: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_id": self.device_id,
            "order_id": self.order_id,
            "spec_id": self.spec_id,
            "status": self.status,
            "submodel": self.submodel,
            "models": list(self.models),
            "bundle": self.bundle,
            "files": dict(self.files),
            "parity": self.parity,
            "latency_ms": self.latency_ms,
            "accuracy": self.accuracy,
            "tensorrt": self.tensorrt,
            "error": self.error,
            "seconds": self.seconds,
        }


def cut(text: str, limit: int = MAX_TEXT) -> str:
    """`text` shortened to `limit` characters (marked), so an error report always fits a control frame."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def encode_export_report(report: ExportReport, session: str) -> bytes:
    meta = {**report.to_dict(), "session": session}
    for name in ("device_id", "spec_id"):
        del meta[name]
    meta["error"] = None if report.error is None else cut(report.error)
    payload = encode_message(
        EXPORT_REPORT, {"device_id": report.device_id, "spec_id": report.spec_id, "meta": _json_safe(meta)}
    )
    decode_export_report(payload)  # refuse to send what the server would refuse (size, types, a long path)
    return payload


def _text(meta: dict[str, Any], name: str, limit: int, *, optional: bool = False) -> str | None:
    value = meta.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise WireError(f"field {name!r} must be a string of at most {limit} characters, got {value!r:.40}")
    return value


def _table(value: Any, name: str, depth: int) -> dict[str, Any]:
    """A small JSON table of numbers, booleans, short strings and nested tables (depth levels at most)."""
    if not isinstance(value, dict) or len(value) > MAX_KEYS:
        raise WireError(f"field {name!r} must be an object of at most {MAX_KEYS} entries")
    for key, item in value.items():
        where = f"{name}.{key}"
        if not isinstance(key, str) or not 0 < len(key) <= 64:
            raise WireError(f"field {name!r} has a key that is not a string of 1-64 characters")
        if isinstance(item, dict):
            if depth <= 1:
                raise WireError(f"field {where!r} nests too deep")
            _table(item, where, depth - 1)
        elif isinstance(item, float) and not math.isfinite(item):
            raise WireError(f"field {where!r} is not finite")
        elif isinstance(item, str) and len(item) > MAX_TEXT:
            raise WireError(f"field {where!r} is longer than {MAX_TEXT} characters")
        elif item is not None and not isinstance(item, (bool, int, float, str)):
            raise WireError(f"field {where!r} must be a number, boolean, string or null")
    return value


def _files(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or len(value) > MAX_FILES:
        raise WireError(f"field 'files' must be an object of at most {MAX_FILES} entries")
    for name, digest in value.items():
        if (
            not isinstance(name, str)
            or not 0 < len(name) <= 128
            or "/" in name
            or "\\" in name
            or name in (".", "..")
        ):
            raise WireError(f"field 'files' names an illegal file {name!r:.60}")
        if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _SHA256_HEX:
            raise WireError(f"field 'files' gives {name!r} a sha256 that is not 64 hex digits")
    return value


_REPORT_FIELDS = frozenset(
    {"order_id", "session", "status", "submodel", "models", "bundle", "files", "parity", "latency_ms"}
    | {"accuracy", "tensorrt", "error", "seconds"}
)


def decode_export_report(payload: bytes) -> tuple[ExportReport, str]:
    """(ExportReport, the server session it answers); control-sized, no tensors, every field checked."""
    message = decode_message(payload, max_bytes=CONTROL_BYTES)
    meta = _expect(message, EXPORT_REPORT)
    if message.device_id is None or message.spec_id is None or message.tensors:
        raise WireError("an export report names its device and spec and carries no tensors")
    unknown = sorted(set(meta) - _REPORT_FIELDS)
    if unknown:
        raise WireError(f"export report: unknown field(s) {', '.join(unknown)[:120]}")
    status = meta.get("status")
    if not isinstance(status, str) or status not in REPORT_STATUSES:
        raise WireError(f"field 'status' must be one of {REPORT_STATUSES}, got {status!r:.40}")
    models = meta.get("models")
    if (
        not isinstance(models, list)
        or not all(isinstance(m, str) for m in models)
        or not set(models) <= set(BUNDLE_MODELS)
        or len(models) > len(BUNDLE_MODELS)
    ):
        raise WireError(f"field 'models' must list some of {BUNDLE_MODELS}, got {models!r:.60}")
    seconds = meta.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < 1e7:
        raise WireError(f"field 'seconds' must be a number >= 0, got {seconds!r:.40}")
    report = ExportReport(
        device_id=message.device_id,
        order_id=_short(meta, "order_id"),
        spec_id=message.spec_id,
        status=status,
        submodel=_text(meta, "submodel", 128) or "",
        models=list(models),
        bundle=_text(meta, "bundle", MAX_PATH, optional=True),
        files=_files(meta.get("files")),
        parity=_table(meta.get("parity"), "parity", 2),
        latency_ms=_table(meta.get("latency_ms"), "latency_ms", 3),
        accuracy=_table(meta.get("accuracy"), "accuracy", 1),
        tensorrt=_table(meta.get("tensorrt"), "tensorrt", 1),
        error=_text(meta, "error", MAX_TEXT, optional=True),
        seconds=float(seconds),
    )
    if report.status == "ok" and (not report.models or report.bundle is None):
        raise WireError("an 'ok' export report names its bundle folder and the models in it")
    if report.status == "failed" and not report.error:
        raise WireError("a 'failed' export report says why in 'error'")
    return report, _short(meta, "session")
