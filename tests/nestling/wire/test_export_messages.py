"""The end-of-run export order and export report on the wire: round trips, and every refusal named."""

from __future__ import annotations

import pytest
import torch

from nestling.errors import WireError
from nestling.models.config import ModelConfig
from nestling.spec import SubmodelSpec
from nestling.wire.codec import decode_message, encode_message
from nestling.wire.export_messages import (
    EXPORT_REPORT,
    ExportOrder,
    ExportReport,
    decode_export_order,
    decode_export_report,
    encode_export_order,
    encode_export_report,
)
from nestling.wire.fleet_messages import CONTROL_BYTES

SPEC = SubmodelSpec(ModelConfig(arch="tinycnn", num_classes=10, in_channels=1, image_size=16), width=0.5)
SHA = "ab" * 32


def order(**changes) -> ExportOrder:
    made = ExportOrder(
        device_id="board-1",
        round=4,
        order_id="export-r4-board-1",
        name="k2",
        spec=SPEC.to_dict(),
        weights={"head.weight": torch.randn(10, 8), "steps": torch.ones(3)},
        static_bn=True,
        active_width=0.5,
        method="nefl-wd",
    )
    for key, value in changes.items():
        setattr(made, key, value)
    return made


def report(**changes) -> ExportReport:
    made = ExportReport(
        device_id="board-1",
        order_id="export-r4-board-1",
        spec_id=SPEC.id,
        status="ok",
        submodel="k2",
        models=["onnx"],
        bundle="/home/pi/.nestling/bundles/lab/board-1",
        files={"model.onnx": SHA, "bundle.json": "cd" * 32},
        parity={"onnx_fp32": {"max_abs": 2e-7, "max_rel": 3e-7, "top1_agreement": 1.0}},
        latency_ms={"batch_1": {"onnxruntime": {"p50_ms": 0.03, "p90_ms": 0.08}}},
        accuracy={"onnx_fp32": 0.9},
        seconds=1.5,
        tensorrt={"requested": True, "built": False, "reason": "no GPU", "precision": "fp16"},
    )
    for key, value in changes.items():
        setattr(made, key, value)
    return made


def test_an_order_round_trips_with_its_weights_and_evaluation_flags():
    sent = order()
    received, session = decode_export_order(decode_message(encode_export_order(sent, "s1")))
    assert session == "s1" and received.spec == sent.spec and received.spec_id == SPEC.id
    assert (received.device_id, received.round, received.order_id, received.name, received.method) == (
        "board-1",
        4,
        "export-r4-board-1",
        "k2",
        "nefl-wd",
    )
    assert (received.ensemble, received.static_bn, received.active_width) == (False, True, 0.5)
    assert all(torch.equal(received.weights[k], v) for k, v in sent.weights.items())


@pytest.mark.parametrize(
    "meta, error",
    [
        ({"ensemble": 1}, "'ensemble' must be true or false"),
        ({"static_bn": None}, "'static_bn' must be true or false"),
        ({"active_width": 2.0}, "'active_width'"),
        ({"active_width": True}, "'active_width'"),
        ({"spec": "k2"}, "'spec' must be an object"),
        ({"order_id": ""}, "'order_id' must have 1-128 characters"),
        ({"session": None}, "'session'"),
    ],
)
def test_a_malformed_order_is_refused_naming_the_field(meta, error):
    good = decode_message(encode_export_order(order(), "s1"))
    forged = encode_message(
        "export", {"round": 4, "device_id": "board-1", "spec_id": SPEC.id, "meta": {**good.meta, **meta}}
    )
    with pytest.raises(WireError, match=error):
        decode_export_order(decode_message(forged))


def test_an_order_names_its_round_device_and_spec():
    good = decode_message(encode_export_order(order(), "s1"))
    forged = encode_message("export", {"device_id": "board-1", "spec_id": SPEC.id, "meta": good.meta})
    with pytest.raises(WireError, match="names its round, device and spec"):
        decode_export_order(decode_message(forged))
    with pytest.raises(WireError, match="expected a 'export' message"):
        decode_export_order(decode_message(encode_message("task", {"meta": {}})))


def test_a_report_round_trips_and_stays_a_control_message():
    sent = report()
    payload = encode_export_report(sent, "s1")
    assert len(payload) < 4096
    received, session = decode_export_report(payload)
    assert session == "s1" and received == sent


def test_a_failure_report_carries_its_error_cut_to_size():
    sent = report(
        status="failed",
        models=[],
        bundle=None,
        files={},
        parity={},
        latency_ms={},
        accuracy={},
        error="SpecError: " + "x" * 10_000,
    )
    received, _ = decode_export_report(encode_export_report(sent, "s1"))
    assert (
        received.status == "failed"
        and received.error.startswith("SpecError: ")
        and len(received.error) == 2000
    )


def test_non_finite_measurements_travel_as_null():
    sent = report(
        parity={"onnx_fp32": {"max_abs": float("nan"), "max_rel": float("inf"), "top1_agreement": 1.0}}
    )
    received, _ = decode_export_report(encode_export_report(sent, "s1"))
    assert received.parity["onnx_fp32"] == {"max_abs": None, "max_rel": None, "top1_agreement": 1.0}


def forged_report(**meta_changes) -> bytes:
    meta = {**report().to_dict(), "session": "s1", **meta_changes}
    del meta["device_id"], meta["spec_id"]
    return encode_message("export_report", {"device_id": "board-1", "spec_id": SPEC.id, "meta": meta})


@pytest.mark.parametrize(
    "meta, error",
    [
        ({"status": "maybe"}, "'status' must be one of"),
        ({"models": ["onnx", "coreml"]}, "'models' must list some of"),
        ({"models": "onnx"}, "'models' must list some of"),
        ({"seconds": -1}, "'seconds' must be a number >= 0"),
        ({"bundle": "/x" * 600}, "'bundle' must be a string of at most 1024"),
        ({"files": {"../model.onnx": SHA}}, "illegal file"),
        ({"files": {"model.onnx": "not-a-sha"}}, "64 hex digits"),
        ({"files": {f"f{i}": SHA for i in range(17)}}, "at most 16 entries"),
        ({"parity": {"onnx_fp32": {"random": {"max_abs": 1.0}}}}, "nests too deep"),
        ({"parity": {"onnx_fp32": [1, 2]}}, "must be a number, boolean, string or null"),
        ({"accuracy": {f"k{i}": 0.5 for i in range(65)}}, "at most 64 entries"),
        ({"latency_ms": None}, "'latency_ms' must be an object"),
        ({"error": 42}, "'error' must be a string"),
        ({"bundle": None}, "names its bundle folder"),
        ({"status": "failed", "error": None}, "says why in 'error'"),
    ],
)
def test_a_malformed_report_is_refused_naming_the_field(meta, error):
    with pytest.raises(WireError, match=error):
        decode_export_report(forged_report(**meta))


def test_an_oversized_report_or_one_with_tensors_is_refused():
    meta = decode_message(forged_report()).meta
    huge = encode_message(
        "export_report",
        {"device_id": "board-1", "spec_id": SPEC.id, "meta": meta},
        {"padding": torch.zeros(CONTROL_BYTES // 4)},
    )
    with pytest.raises(WireError, match="exceeds the limit"):
        decode_export_report(huge)
    with_tensors = encode_message(
        "export_report", {"device_id": "board-1", "spec_id": SPEC.id, "meta": meta}, {"w": torch.zeros(2)}
    )
    with pytest.raises(WireError, match="carries no tensors"):
        decode_export_report(with_tensors)


def test_the_encoder_refuses_what_the_server_would_refuse():
    with pytest.raises(WireError, match="'bundle' must be a string of at most 1024"):
        encode_export_report(report(bundle="/deep" * 300), "s1")


def test_a_report_with_an_unknown_field_or_unhashable_models_is_refused_by_name() -> None:
    base = {"order_id": "o", "session": "s", "status": "failed", "models": [], "files": {}, "parity": {}}
    base |= {"latency_ms": {}, "accuracy": {}, "tensorrt": {}, "error": "x", "seconds": 1.0}
    for meta, named in (({**base, "steer": 1}, "unknown field"), ({**base, "models": [{}]}, "models")):
        payload = encode_message(EXPORT_REPORT, {"device_id": "d", "spec_id": "x", "meta": meta})
        with pytest.raises(WireError, match=named):
            decode_export_report(payload)
