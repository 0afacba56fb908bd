"""MqttTransport on a real (embedded) broker: registration, tasks out, results in, and every refusal counted."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from itertools import count

import pytest
import torch

from nestling.messages import Task
from nestling.server.broker import EmbeddedBroker
from nestling.server.clock import WallClock
from nestling.server.mqtt_transport import MqttTransport, TransportSettings
from nestling.server.registry import DeviceRegistry
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.wire.client import make_client
from nestling.wire.codec import pack_frame, read_header
from nestling.wire.fleet_messages import DeviceStatus, encode_hello, encode_result, encode_status
from nestling.wire.topics import OFFLINE, FleetTopics
from tests.server.fleet_harness import FakeDevice, echo_result

torch.set_num_threads(1)
_fleets = count()


@pytest.fixture(scope="module")
def broker():
    with EmbeddedBroker() as running:
        yield running


@pytest.fixture
def fleet():
    return f"t{next(_fleets)}"


@pytest.fixture
def strategy():
    ctx = StrategyContext(
        arch="tinycnn", num_classes=10, in_channels=1, image_size=16, num_clients=2, total_rounds=3
    )
    return create_strategy("nefl-wd", ctx)


@pytest.fixture
def transport(broker, fleet):
    topics = FleetTopics(fleet)
    client = make_client(f"server-{fleet}", will=(topics.server_status, OFFLINE, True))
    made = MqttTransport(
        client,
        topics,
        DeviceRegistry(heartbeat_timeout_s=30),
        WallClock(),
        TransportSettings(chunk_size=1024, stall_s=0.3, device_wait_s=5),
    )
    made.connect(broker.host, broker.port)
    yield made
    made.close()


@pytest.fixture
def device(broker, fleet):
    made = FakeDevice(broker.host, broker.port, fleet, "board-a")
    yield made
    made.close()


def registered(transport, device, **profile):
    device.hello(**profile)
    devices = transport.wait_for_devices(1, 5)
    assert [d.device_id for d in devices] == [device.device_id]
    return devices[0]


def dispatch_one(transport, device, strategy) -> tuple[Task, str]:
    info = registered(transport, device)  # index 0: the smallest tier
    task = strategy.assign(0, [info])[device.device_id]
    transport.dispatch([task])
    received, session = device.next_task()
    assert received.task_id == task.task_id and session == transport.session
    return received, session


def collect(transport, seconds=5.0, want=1):
    return transport.wait(transport.clock.now() + seconds, want)


def rejections(transport) -> dict[str, int]:
    return {k: v for k, v in transport.counters.items() if k.startswith("rejected_")}


def pump_until(transport, condition, timeout=5.0) -> None:
    """Let the transport handle its inbox (as the coordinator's wait would) until `condition` holds."""
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, "timed out waiting for the transport"
        transport.wait_for_devices(10**6, 0.1)


def test_hello_registers_the_device_with_its_profile(transport, device):
    info = registered(transport, device, memory_budget_bytes=64 << 20, labels=[3, 1, 1], index=4, tier=2)
    assert (info.num_samples, info.memory_budget_bytes, info.labels) == (100, 64 << 20, (1, 3))
    assert (info.index, info.tier) == (0, None)  # the enrolment's seat, not what the hello claimed


def test_a_chunked_task_arrives_whole_and_its_echo_is_accepted_once(transport, device, strategy):
    task, session = dispatch_one(transport, device, strategy)
    assert all(
        torch.equal(v, strategy.assign(0, [transport.registry.available()[0]])[device.device_id].weights[k])
        for k, v in task.weights.items()
    )
    device.send_result(echo_result(task), session, chunk_size=1024)
    delivery = collect(transport)
    assert [r.task_id for r in delivery.results] == [task.task_id]
    device.send_result(echo_result(task), session)  # a QoS 1 redelivery / a retry
    # Nothing is pending any more, so a wait may return before the copy lands: pump until it is handled.
    pump_until(transport, lambda: transport.counters.get("rejected_duplicate", 0) >= 1)
    assert transport.counters["rejected_duplicate"] == 1
    assert transport.counters["accepted"] == 1 and transport.idle()


def test_only_the_missing_chunks_are_requested_again(transport, device, strategy):
    task, session = dispatch_one(transport, device, strategy)
    device.send_result(echo_result(task), session, chunk_size=1024, skip=(1, 3))
    with ThreadPoolExecutor(1) as pool:  # the coordinator waits while the device answers the re-request
        waiting = pool.submit(collect, transport)
        assert device.answer_rerequest() == (1, 3)
        delivery = waiting.result()
    assert len(delivery.results) == 1 and transport.counters["rerequests"] == 1


@pytest.mark.parametrize(
    "breakage, reason",
    [
        (lambda t: {"weights": {**t.weights, "extra.weight": torch.zeros(2)}}, "wrong_tensors"),
        (
            lambda t: {
                "weights": {
                    k: torch.zeros(3, 3) if i == 0 else v for i, (k, v) in enumerate(t.weights.items())
                }
            },
            "wrong_tensors",
        ),
        (
            lambda t: {
                "weights": {k: v.double() if v.is_floating_point() else v for k, v in t.weights.items()}
            },
            "wrong_tensors",
        ),
        (
            lambda t: {
                "weights": {
                    k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
                    for k, v in t.weights.items()
                }
            },
            "non_finite",
        ),
        (lambda t: {"round": 7}, "future"),  # round 7 has not started: not "stale"
        (lambda t: {"task_id": "r0-someone-else"}, "unknown_task"),
        (lambda t: {"device_id": "board-b"}, "wrong_device"),
    ],
)
def test_results_that_do_not_match_their_task_are_refused(transport, device, strategy, breakage, reason):
    task, session = dispatch_one(transport, device, strategy)
    device.send_result(echo_result(task, **breakage(task)), session)
    delivery = collect(transport, 2.0)
    assert delivery.results == [] and delivery.rejected == [(device.device_id, reason)]
    # a result refused for its content is the board's answer (the transport is idle: a round would close); one
    # for another round, task or device is not. Either way the device's real result still counts while it is open
    assert transport.idle() == (reason in ("wrong_tensors", "non_finite"))
    device.send_result(echo_result(task), session)
    results: list = []
    pump_until(transport, lambda: results.extend(collect(transport, 0.2).results) or results)
    assert len(results) == 1


def test_corrupt_and_foreign_frames_are_refused_with_their_reason(transport, device, strategy, broker, fleet):
    task, session = dispatch_one(transport, device, strategy)
    good = bytearray(encode_result(echo_result(task), session))
    flipped = bytearray(good)
    flipped[-5] ^= 0xFF
    device.publish("result", bytes(flipped))
    device.publish("result", b"{not a frame")
    device.publish("result", pack_frame("result", {"meta": {}}).replace(b'"schema":1', b'"schema":9'))
    device.send_result(echo_result(task), "another-server")
    stranger = FakeDevice(broker.host, broker.port, fleet, "stranger")
    stranger.send_result(echo_result(task, device_id="stranger"), session)
    stranger.close()
    pump_until(transport, lambda: sum(rejections(transport).values()) >= 5)
    assert rejections(transport) == {
        "rejected_sha_mismatch": 1,
        "rejected_malformed": 1,
        "rejected_unknown_schema": 1,
        "rejected_stale_session": 1,
        "rejected_unknown_device": 1,
    }
    assert transport.counters["accepted"] == 0


def test_an_oversized_result_is_refused_before_it_is_buffered(transport, device, strategy):
    task, session = dispatch_one(transport, device, strategy)
    huge = echo_result(task)
    huge.metrics = {"padding": "x" * 1000}
    huge.weights = {**task.weights}
    first = next(iter(huge.weights))
    huge.weights[first] = torch.zeros(2_000_000)
    device.send_result(huge, session, chunk_size=256 * 1024)
    pump_until(transport, lambda: rejections(transport))
    assert transport.counters["rejected_oversized"] == 1 and transport.counters["accepted"] == 0


def test_results_after_the_round_closed_are_late(transport, device, strategy):
    task, session = dispatch_one(transport, device, strategy)
    transport.cancel(0)
    device.send_result(echo_result(task), session)
    pump_until(transport, lambda: rejections(transport))
    assert transport.counters["rejected_late"] == 1 and transport.counters["accepted"] == 0


def test_a_vanished_device_is_reported_dropped_and_the_round_goes_idle(transport, broker, fleet, strategy):
    board = FakeDevice(broker.host, broker.port, fleet, "board-z")
    dispatch_one(transport, board, strategy)
    assert not transport.idle()
    board.close(abrupt=True)
    delivery = collect(transport, 10.0)
    assert delivery.dropped == ["board-z"] and transport.idle()
    assert transport.registry.available() == []


def test_wait_blocks_on_the_wall_clock_until_the_deadline(transport, device, strategy):
    dispatch_one(transport, device, strategy)
    started = time.monotonic()
    delivery = transport.wait(transport.clock.now() + 0.8, 1)
    assert delivery.results == [] and 0.7 < time.monotonic() - started < 2.0


def test_heartbeats_keep_a_device_available_and_silence_expires_it(broker, fleet, device):
    topics = FleetTopics(fleet)
    client = make_client(f"server-{fleet}", will=(topics.server_status, OFFLINE, True))
    transport = MqttTransport(
        client,
        topics,
        DeviceRegistry(heartbeat_timeout_s=0.6),
        WallClock(),
        TransportSettings(device_wait_s=2),
    )
    transport.connect(broker.host, broker.port)
    try:
        device.publish("hello", encode_hello(device.device_id, {"num_samples": 5}))
        for _ in range(4):
            device.publish("status", encode_status(DeviceStatus(device.device_id, "online", None, {})))
            assert [d.device_id for d in transport.wait_for_devices(1, 2)] == [device.device_id]
            time.sleep(0.3)
        time.sleep(1.0)
        assert transport.wait_for_devices(1, 0.5) == []
    finally:
        transport.close()


def test_a_status_from_an_unknown_device_asks_it_to_say_hello(transport, device):
    device.publish("status", encode_status(DeviceStatus(device.device_id, "online", None, {})))
    transport.wait_for_devices(1, 1.0)
    assert read_header(device.next_ctrl(5))["kind"] == "rehello"
