"""The enrolment: who may join a fleet, at which index and tier — refused strangers, seats that hold, a real round."""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

import pytest

from nestling.errors import WireError
from nestling.server.broker import EmbeddedBroker
from nestling.server.clock import WallClock
from nestling.server.coordinator import Coordinator, RoundPolicy
from nestling.server.enrolment import Enrolment, enrolment_toml, read_enrolment_file
from nestling.server.mqtt_transport import MqttTransport, TransportSettings
from nestling.server.registry import DeviceRegistry
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.wire.client import connect_and_wait, make_client
from nestling.wire.fleet_messages import DeviceStatus, encode_hello, encode_status
from nestling.wire.topics import OFFLINE, QOS, FleetTopics
from tests.server.fleet_harness import FakeDevice, echo_result, wait_until

FLEET = "enrolled"
GHOSTS = 40


def test_a_closed_enrolment_indexes_by_position_and_refuses_everyone_else():
    enrolment = Enrolment.closed(["x", "y", "z"], {"z": 3})
    indices: dict[str, int] = {}
    assert [enrolment.admit(d, indices) for d in ("z", "x")] == [
        enrolment.devices["z"],
        enrolment.devices["x"],
    ]
    assert indices == {"z": 2, "x": 0} and enrolment.devices["z"].tier == 3
    for stranger in ("w", "X", "x "):
        assert not enrolment.admits(stranger)
        with pytest.raises(WireError, match="is not enrolled") as refused:
            enrolment.admit(stranger, indices)
        assert refused.value.reason == "not_enrolled"
    assert indices == {"z": 2, "x": 0}


def test_an_open_enrolment_seats_in_order_of_arrival_up_to_its_capacity():
    enrolment = Enrolment.open_to(2)
    indices = {"back-again": 1}  # a seat kept in registry.json by an earlier server
    assert enrolment.admit("new", indices).index == 0
    assert enrolment.admit("back-again", indices).index == 1
    with pytest.raises(WireError, match="2 seats are taken"):
        enrolment.admit("third", indices)
    assert enrolment.admit("new", indices).index == 0  # a seated board is always welcome back


def test_the_written_enrolment_file_reads_back(tmp_path):
    path = tmp_path / "enrolment.toml"
    path.write_text(enrolment_toml("lab", ["device-000", "device-001"]))
    assert read_enrolment_file(path, "lab") == (["device-000", "device-001"], {})


def ghost_flood(host: str, port: int, topics: FleetTopics) -> queue.Queue:
    """A stranger with broker access says hello (a valid profile) and heartbeats as GHOSTS made-up devices;
    returns what the server sends back to them."""
    stranger = make_client("stranger")
    heard: queue.Queue = queue.Queue()
    stranger.on_message = lambda _c, _u, message: heard.put(message.topic)
    connect_and_wait(stranger, host, port)
    stranger.subscribe(topics.all_devices("ctrl"), qos=QOS)
    stranger.subscribe(topics.all_devices("task"), qos=QOS)
    for n in range(GHOSTS):
        ghost = f"ghost-{n:02d}"
        hello = encode_hello(ghost, {"num_samples": 500, "index": n % 2, "tier": 0})
        stranger.publish(topics.hello(ghost), hello, qos=QOS).wait_for_publish(5)
        status = encode_status(DeviceStatus(ghost, "online", None, {}))
        stranger.publish(topics.status(ghost), status, qos=QOS).wait_for_publish(5)
    return heard


def test_forty_ghosts_and_a_claimed_index_change_nothing_in_a_real_round():
    """40 made-up device ids used to fill every round's selection; a hello claiming another board's index
    used to move every other board up a tier."""
    with EmbeddedBroker() as broker:
        topics = FleetTopics(FLEET)
        ctx = StrategyContext(
            arch="tinycnn", num_classes=10, in_channels=1, image_size=16, num_clients=2, total_rounds=1
        )
        strategy = create_strategy("nefl-wd", ctx)
        registry = DeviceRegistry(enrolment=Enrolment.closed(["board-0", "board-1"]))
        transport = MqttTransport(
            make_client("enrolled-server", will=(topics.server_status, OFFLINE, True)),
            topics,
            registry,
            WallClock(),
            TransportSettings(chunk_size=4096, device_wait_s=10, rehello_every_s=0.0),
        )
        transport.connect(broker.host, broker.port)
        boards = [FakeDevice(broker.host, broker.port, FLEET, f"board-{i}") for i in range(2)]
        try:
            heard = ghost_flood(broker.host, broker.port, topics)
            boards[1].hello(index=0, tier=0)  # board-1 claims board-0's index and the smallest tier
            boards[0].hello(index=1)

            def refused_all() -> bool:
                transport.wait_for_devices(10**6, 0.1)  # pumps the inbox
                return transport.counters.get("rejected_not_enrolled", 0) >= GHOSTS

            wait_until(refused_all, 30, f"{GHOSTS} ghost hellos refused")
            devices = transport.wait_for_devices(2, 10)
            assert sorted((d.device_id, d.index, d.tier) for d in devices) == [
                ("board-0", 0, None),
                ("board-1", 1, None),
            ]
            policy = RoundPolicy(rounds=1, fraction=1.0, quorum=1.0, deadline_s=60.0)
            coordinator = Coordinator(strategy, transport, WallClock(), None, policy)
            with ThreadPoolExecutor(1) as pool:
                round_zero = pool.submit(coordinator.run_round, 0)
                for board in boards:
                    task, session = board.next_task()
                    board.send_result(echo_result(task), session)
                record = round_zero.result(timeout=60)
            assert (record.selected, record.accepted, record.aggregated) == (2, 2, True)
            assert sorted(registry.records) == ["board-0", "board-1"]
            assert transport.counters["rejected_not_enrolled"] == GHOSTS
            to_ghosts: list[str] = []
            while not heard.empty():  # the stranger hears the boards' tasks too (an open broker): not ours
                topic = heard.get_nowait()
                to_ghosts += [topic] if "/ghost-" in topic else []
            assert to_ghosts == []  # no task, and no "say hello again", to a ghost
        finally:
            for board in boards:
                board.close()
            transport.close()
