"""End to end: a two-round fleet run ends with one board building its own deployable from the final model.

`nestling server` (in this process) and two `nestling agent` processes on the embedded broker; dev-0's
agent.toml asks for the final model as a TensorRT bundle, dev-1's does not ask. On this CPU-only machine
dev-0 must still deliver a verified ONNX bundle, say why TensorRT was skipped, and the run summary must
list it with its parity, and list dev-1 as not exporting.
"""

from __future__ import annotations

import json
import re
import textwrap
import time

import numpy as np
import pytest
import torch

from nestling.data import load_dataset
from nestling.export.infer import infer_main
from nestling.hashing import sha256_file
from nestling.server.broker import EmbeddedBroker
from nestling.server.clock import WallClock
from nestling.server.deployables import export_orders
from nestling.server.enrolment import Enrolment
from nestling.server.fleet import run_fleet
from nestling.server.fleet_config import load_fleet_config
from nestling.server.mqtt_transport import MqttTransport, TransportSettings
from nestling.server.registry import DeviceRegistry
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.wire.chunking import encode_chunk_request
from nestling.wire.client import make_client
from nestling.wire.codec import CHUNK_KIND, decode_message, encode_message, read_header
from nestling.wire.export_messages import ExportReport, decode_export_order, encode_export_report
from nestling.wire.topics import OFFLINE, FleetTopics
from nestling.wire.transfers import Inbound
from tests.server.fleet_harness import FakeDevice, agent_toml, fleet_toml, spawn, stop_all

FLEET = "export-e2e"


def test_a_run_ends_with_the_exporting_board_holding_a_verified_bundle_listed_in_the_summary(
    tmp_path, capsys
):
    bundle = tmp_path / "board-bundles" / "dev-0"
    with EmbeddedBroker() as broker:
        config = tmp_path / "fleet.toml"
        # 4 KiB chunks: tasks and the export order travel chunked
        config.write_text(
            fleet_toml(broker.url, FLEET, devices=2, rounds=2, extra_fleet="chunk_kb = 4")
            + '[export]\non_finish = "requested"\ntimeout_s = 60\n'
        )
        agents = []
        # tinycnn at batch 16 needs ~0.96 MB for NeFL's k1 and 1.33 MB for the largest (profiler.planner)
        for i, budget in enumerate((1.0, 64.0)):
            text = agent_toml(broker.url, FLEET, f"dev-{i}", index=i, clients=2, budget_mb=budget)
            if i == 0:
                text += textwrap.dedent(f"""\
                    [export]
                    on_finish = true
                    format = "tensorrt"
                    out_dir = "{bundle}"
                    eval_samples = 200
                    """)
            (tmp_path / f"agent-{i}.toml").write_text(text)
            agents.append(
                spawn(
                    "nestling.edge.agent_cli",
                    ["--config", str(tmp_path / f"agent-{i}.toml")],
                    tmp_path / f"agent-{i}.log",
                )
            )
        try:
            summary = run_fleet(load_fleet_config(config))
        finally:
            stop_all(agents)
    logs = "\n".join((tmp_path / f"agent-{i}.log").read_text() for i in range(2))

    assert summary["rounds"] == 2 and summary["transport"]["export_orders"] == 1
    assert not {k: v for k, v in summary["transport"].items() if k.startswith("rejected_")}, logs
    rows = {row["device_id"]: row for row in summary["deployables"]}
    assert rows["dev-1"] == {"device_id": "dev-1", "status": "not requested"}
    row = rows["dev-0"]
    assert row["status"] == "ok", (row, logs)
    k1 = next(s["id"] for s in summary["submodels"] if s["name"] == "k1")
    assert (row["submodel"], row["spec_id"]) == ("k1", k1)  # the submodel its memory budget buys
    assert row["models"] == ["onnx"] and row["bundle"] == str(bundle.resolve())
    assert row["tensorrt"]["requested"] is True and row["tensorrt"]["built"] is False
    assert (
        "TensorRT skipped, ONNX only" in row["tensorrt"]["reason"]
        and "NVIDIA GPU" in row["tensorrt"]["reason"]
    )
    assert row["parity"]["onnx_fp32"]["max_rel"] <= 1e-4 and row["parity"]["onnx_fp32"]["max_abs"] <= 1e-4
    assert row["latency_ms"]["batch_1"]["onnxruntime"]["p50_ms"] > 0
    assert row["files"] == {name: sha256_file(bundle / name) for name in row["files"]}
    assert set(row["files"]) == {"model.onnx", "bundle.json"}
    assert (
        json.loads((tmp_path / "out" / "summary.json").read_text())["deployables"] == summary["deployables"]
    )

    printed = capsys.readouterr().out
    assert re.search(r"^dev-0 +ok +k1 +onnx +\d", printed, re.MULTILINE), printed
    assert re.search(r"^dev-1 +not requested", printed, re.MULTILINE), printed

    # the board's bundle runs with `nestling infer` (onnxruntime + numpy) and classifies real digits
    test = load_dataset("digits", None, seed=0).test
    inputs = tmp_path / "digits.npy"
    np.save(inputs, test.x[:8].numpy())
    assert infer_main(["--bundle", str(bundle), str(inputs), "--json"]) == 0
    predictions = json.loads(capsys.readouterr().out)
    assert len(predictions) == 8 and all(0 <= p["index"] < 10 for p in predictions)


# -- the server's side on a real broker, against a scripted board ------------------------------
@pytest.fixture
def exchange():
    """A server transport and a scripted board that asked for its final model, on an embedded broker."""
    with EmbeddedBroker() as broker:
        topics = FleetTopics("scripted")
        client = make_client("server-scripted", will=(topics.server_status, OFFLINE, True))
        transport = MqttTransport(
            client,
            topics,
            DeviceRegistry(heartbeat_timeout_s=30, enrolment=Enrolment.closed(["board-a"], {"board-a": 0})),
            WallClock(),
            TransportSettings(chunk_size=1024, stall_s=0.3, device_wait_s=5),
        )
        transport.connect(broker.host, broker.port)
        board = FakeDevice(broker.host, broker.port, "scripted", "board-a")
        board.hello(export={"on_finish": True, "format": "onnx"})
        (info,) = transport.wait_for_devices(1, 5)
        ctx = StrategyContext(
            arch="tinycnn", num_classes=10, in_channels=1, image_size=16, num_clients=2, total_rounds=1
        )
        (order,) = export_orders(create_strategy("nefl-wd", ctx), [info], 0, "requested")
        try:
            yield transport, board, order
        finally:
            board.close()
            transport.close()


def pump_until(transport, condition, timeout=5.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, dict(transport.counters)
        transport.wait_for_devices(10**6, 0.1)


def good_report(order, **changes) -> ExportReport:
    made = ExportReport(
        order.device_id,
        order.order_id,
        order.spec_id,
        "ok",
        submodel=order.name,
        models=["onnx"],
        bundle="/srv/bundle",
        parity={"onnx_fp32": {"max_abs": 1e-7, "max_rel": 1e-7}},
    )
    for key, value in changes.items():
        setattr(made, key, value)
    return made


def test_a_lost_chunk_of_the_export_order_is_sent_again_on_the_ctrl_topic(exchange):
    transport, board, order = exchange
    transport.send_exports([order])
    chunks = []
    while not chunks or len(chunks) < read_header(chunks[0])["count"]:
        chunks.append(board.next_ctrl())
    assert len(chunks) > 2 and all(read_header(c)["kind"] == CHUNK_KIND for c in chunks)
    for index, chunk in enumerate(chunks):
        if index != 1:
            assert board.inbound.add(chunk) is None
    board.publish("result", encode_chunk_request(read_header(chunks[0])["transfer_id"], [1]))
    pump_until(transport, lambda: transport.counters.get("export_chunks_resent", 0) == 1)
    resent = board.next_ctrl()  # on ctrl, where the board listens for its order, not on its task topic
    received, session = decode_export_order(decode_message(board.inbound.add(resent)))
    assert (received.order_id, received.spec_id, session) == (
        order.order_id,
        order.spec_id,
        transport.session,
    )
    assert all(torch.equal(received.weights[k], v) for k, v in order.weights.items())


def test_reports_are_admitted_once_and_bad_ones_refused_with_a_named_reason(exchange):
    transport, board, order = exchange
    transport.send_exports([order])
    forged = {"session": transport.session, **good_report(order).to_dict(), "status": "perhaps"}
    del forged["device_id"], forged["spec_id"]
    board.publish(
        "result",
        encode_message("export_report", {"device_id": "board-a", "spec_id": order.spec_id, "meta": forged}),
    )
    board.publish("result", encode_export_report(good_report(order), "old-session"))
    board.publish(
        "result", encode_export_report(good_report(order, order_id="export-r7-board-a"), transport.session)
    )
    board.publish("result", encode_export_report(good_report(order, spec_id="abc"), transport.session))
    board.publish(
        "result",
        encode_message(
            "export_report", {"device_id": "board-a", "meta": {}}, {"padding": torch.zeros(20_000)}
        ),
    )
    assert transport.wait_exports(0.5) == {}
    board.publish("result", encode_export_report(good_report(order), transport.session))
    reports = transport.wait_exports(5)
    assert reports["board-a"].bundle == "/srv/bundle" and transport.exports.pending() == []
    board.publish("result", encode_export_report(good_report(order), transport.session))
    pump_until(transport, lambda: transport.counters.get("rejected_duplicate", 0) == 1)
    rejected = {k: v for k, v in transport.counters.items() if k.startswith("rejected_")}
    assert rejected == {
        "rejected_malformed": 1,
        "rejected_stale_session": 1,
        "rejected_unknown_export": 1,
        "rejected_wrong_spec": 1,
        "rejected_oversized": 1,
        "rejected_duplicate": 1,
    }
    assert transport.counters["export_reports"] == 1


def test_the_wait_for_reports_ends_at_its_timeout(exchange):
    transport, _board, order = exchange
    transport.send_exports([order])
    started = time.monotonic()
    assert transport.wait_exports(0.6) == {} and 0.5 < time.monotonic() - started < 3
    assert transport.exports.pending() == ["board-a"]


def read_order(board) -> tuple:
    """Collect one whole (chunked) export order from the board's ctrl topic."""
    while True:
        whole = board.inbound.add(board.next_ctrl())
        if whole is not None:
            return decode_export_order(decode_message(whole))


def test_an_order_lost_whole_is_sent_again_when_the_board_registers_anew_until_it_reports(exchange):
    transport, board, order = exchange
    transport.send_exports([order])
    read_order(board)  # the board restarts before exporting: the order is gone with it
    board.inbound = Inbound(256 * 1024 * 1024)
    board.hello(export={"on_finish": True, "format": "onnx"})
    pump_until(transport, lambda: transport.counters.get("export_orders_resent", 0) == 1)
    received, session = read_order(board)
    assert (received.order_id, session) == (order.order_id, transport.session)
    board.publish("result", encode_export_report(good_report(order), transport.session))
    assert transport.wait_exports(5)["board-a"].status == "ok"
    board.hello(export={"on_finish": True, "format": "onnx"})  # reported: nothing more to send
    pump_until(transport, lambda: transport.registry.known("board-a"))
    transport.wait_for_devices(10**6, 0.5)
    assert transport.counters["export_orders_resent"] == 1
