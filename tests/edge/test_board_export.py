"""On the board: an export order becomes a verified bundle and a report; a failure is a report, never a crash."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from nestling.edge.agent import Agent
from nestling.edge.agent_config import DataSection, agent_config_from_dict
from nestling.edge.board_export import export_on_board, replace_folder
from nestling.edge.export_settings import ExportSection
from nestling.edge.procedures import ClientData
from nestling.errors import ConfigError
from nestling.export.bundle import read_bundle
from nestling.export.infer import BundleRunner
from nestling.export.tensorrt_build import _cuda_available
from nestling.hashing import sha256_file
from nestling.server.broker import EmbeddedBroker
from nestling.server.clock import WallClock
from nestling.server.deployables import export_orders
from nestling.server.mqtt_transport import MqttTransport, TransportSettings
from nestling.server.registry import DeviceRegistry
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.server.strategies.base import DeviceInfo
from nestling.wire.client import make_client
from nestling.wire.export_messages import ExportOrder
from nestling.wire.topics import OFFLINE, FleetTopics

torch.set_num_threads(1)
DIGITS = DataSection(dataset="digits")
TENSORRT_HERE = importlib.util.find_spec("tensorrt") is not None and _cuda_available()


def nefl_order(device_id: str = "board-1", tier: int = 1) -> ExportOrder:
    """The order the server sends after a NeFL-WD run on digits: tier `tier`'s weights and its own BN."""
    ctx = StrategyContext(
        arch="tinycnn",
        num_classes=10,
        in_channels=1,
        image_size=16,
        num_clients=5,
        total_rounds=2,
        dataset="digits",
    )
    strategy = create_strategy("nefl-wd", ctx)
    board = DeviceInfo(device_id, 0, 100, tier=tier)
    return export_orders(strategy, [board], 1, "all")[0]


def test_an_order_becomes_a_bundle_that_infer_runs_and_a_report_that_matches_it(tmp_path):
    settings = ExportSection(out_dir=str(tmp_path / "bundle"), calib_samples=64, eval_samples=100)
    order = nefl_order()
    report = export_on_board(order, settings, fleet="lab", device_id="board-1", data=DIGITS)
    assert report.status == "ok", report.error
    assert (report.order_id, report.spec_id, report.submodel, report.models) == (
        order.order_id,
        order.spec_id,
        "k2",
        ["onnx"],
    )
    folder = tmp_path / "bundle"
    assert report.bundle == str(folder.resolve())
    assert report.files == {name: sha256_file(folder / name) for name in ("model.onnx", "bundle.json")}
    assert (
        report.parity["onnx_fp32"]["max_rel"] <= 1e-4 and report.parity["onnx_fp32"]["top1_agreement"] == 1.0
    )
    assert set(report.latency_ms) == {"batch_1", "batch_32"} and report.accuracy["samples"] == 100
    assert report.tensorrt == {"requested": False, "built": False, "reason": None}
    manifest = read_bundle(folder)
    assert manifest["source"] == {
        "fleet": "lab",
        "device": "board-1",
        "method": "nefl-wd",
        "round": 1,
        "order": order.order_id,
        "submodel": "k2",
    }
    assert (
        manifest["input"]["normalization"] is not None
    )  # real digits: images can be fed to `nestling infer`
    x = np.random.default_rng(0).standard_normal((3, 1, 16, 16)).astype(np.float32)
    assert BundleRunner(folder).run(x).shape == (3, 10)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-built folder left behind


@pytest.mark.skipif(TENSORRT_HERE, reason="tensorrt and a CUDA GPU are present: the engine would be built")
def test_tensorrt_asked_for_but_absent_still_ships_onnx_and_says_why(tmp_path):
    settings = ExportSection(format="tensorrt", out_dir=str(tmp_path / "b"), calib_data="none")
    report = export_on_board(nefl_order(), settings, fleet="lab", device_id="board-1", data=DIGITS)
    assert report.status == "ok" and report.models == ["onnx"] and (tmp_path / "b" / "model.onnx").is_file()
    assert report.tensorrt["requested"] is True and report.tensorrt["built"] is False
    assert report.tensorrt["precision"] == "fp16"
    assert report.tensorrt["reason"].startswith(
        "TensorRT skipped, ONNX only: TensorRT export needs tensorrt and an NVIDIA GPU"
    )
    assert "model.plan" not in report.files and read_bundle(tmp_path / "b")["tensorrt"] is None


def test_a_failed_export_is_reported_and_leaves_the_previous_bundle_in_place(tmp_path):
    settings = ExportSection(out_dir=str(tmp_path / "bundle"), calib_data="none")
    good = export_on_board(nefl_order(), settings, fleet="lab", device_id="board-1", data=DIGITS)
    assert good.status == "ok"
    broken = nefl_order()
    first = next(k for k, v in broken.weights.items() if v.dim() == 4)
    broken.weights[first] = torch.zeros(3, 3)  # not the spec's shape
    report = export_on_board(broken, settings, fleet="lab", device_id="board-1", data=DIGITS)
    assert report.status == "failed" and report.models == [] and report.bundle is None
    assert "size mismatch" in report.error or first in report.error
    assert read_bundle(tmp_path / "bundle")["files"]["model.onnx"] == good.files["model.onnx"]
    nan = nefl_order()
    nan.weights[first] = torch.full_like(nan.weights[first], float("nan"))
    assert "NaN or Inf" in export_on_board(nan, settings, fleet="lab", device_id="board-1", data=DIGITS).error
    odd = nefl_order()
    odd.spec = {"model": "nonsense"}
    failed = export_on_board(odd, settings, fleet="lab", device_id="board-1", data=DIGITS)
    assert failed.status == "failed" and failed.spec_id == "invalid-spec"


def test_a_new_bundle_replaces_the_old_folder_whole(tmp_path):
    out, built = tmp_path / "bundle", tmp_path / ".bundle.building"
    out.mkdir()
    (out / "model.plan").write_text("old engine")
    built.mkdir()
    (built / "model.onnx").write_text("new")
    replace_folder(built, out)
    assert [p.name for p in out.iterdir()] == ["model.onnx"] and [p.name for p in tmp_path.iterdir()] == [
        "bundle"
    ]


def test_agent_toml_export_table(tmp_path):
    def load(export: dict) -> ExportSection:
        return agent_config_from_dict({"device": {"id": "b"}, "export": export}, tmp_path).export

    assert load({}).on_finish is False and load({}).advertised() is None
    settings = load({"on_finish": True, "format": "tensorrt", "out_dir": "bundles/here"})
    assert settings.advertised() == {"on_finish": True, "format": "tensorrt"}
    assert settings.bundle_dir("lab", "b") == tmp_path / "bundles" / "here"
    assert ExportSection().bundle_dir("lab", "b") == Path.home() / ".nestling" / "bundles" / "lab" / "b"
    for table, message in (
        ({"format": "coreml"}, "format must be one of onnx, tensorrt"),
        ({"precision": "fp8"}, "precision"),
        ({"quantize": "int4"}, "quantize"),
        ({"quantize": "int8", "calib_data": "none"}, "needs calibration images"),
        ({"calib_samples": 0}, "calib_samples"),
        ({"on_finish": "yes"}, "on_finish must be bool"),
        ({"engine": "trt"}, "unknown keys"),
    ):
        with pytest.raises(ConfigError, match=message):
            load(table)


# -- the agent and the real server transport on a broker ---------------------------------------
@pytest.fixture
def broker():
    with EmbeddedBroker() as running:
        yield running


def test_the_agent_exports_on_its_worker_and_answers_a_repeated_order_without_rebuilding(broker, tmp_path):
    topics = FleetTopics("boards")
    client = make_client("server-boards", will=(topics.server_status, OFFLINE, True))
    transport = MqttTransport(
        client,
        topics,
        DeviceRegistry(heartbeat_timeout_s=30),
        WallClock(),
        TransportSettings(chunk_size=2048, stall_s=0.3, device_wait_s=10),
    )
    transport.connect(broker.host, broker.port)
    config = agent_config_from_dict(
        {
            "broker": {"url": broker.url, "fleet": "boards"},
            "device": {"id": "board-1"},
            "agent": {"heartbeat_s": 0.3, "stall_s": 0.3},
            "export": {"on_finish": True, "out_dir": str(tmp_path / "bundle"), "calib_data": "none"},
        }
    )
    data = ClientData(torch.randn(20, 1, 16, 16), torch.arange(20) % 10)
    agent = Agent(config, data).start()
    try:
        (board,) = transport.wait_for_devices(1, 10)
        assert board.profile["export"] == {"on_finish": True, "format": "onnx"}
        order = nefl_order()
        transport.send_exports([order])  # chunked: 2 KiB chunks on devices/board-1/ctrl
        reports = transport.wait_exports(60)
        assert reports["board-1"].status == "ok", reports["board-1"].error
        assert transport.counters["export_reports"] == 1
        built = (tmp_path / "bundle" / "bundle.json").stat().st_mtime_ns
        transport.send_exports([order])  # a repeat (QoS 1, or a server retry): the report again, no rebuild
        give_up = time.monotonic() + 10
        while transport.counters.get("rejected_duplicate", 0) < 1:
            assert time.monotonic() < give_up, dict(transport.counters)
            transport.wait_for_devices(10**6, 0.1)
        assert (tmp_path / "bundle" / "bundle.json").stat().st_mtime_ns == built
        assert agent.state == "online" and agent.exports.report is not None
    finally:
        agent.stop()
        transport.close()
