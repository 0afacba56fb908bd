"""Over a thousand generated hostile messages at a running server: none crashes it, none is accepted, the model stays put."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from nestling.messages import Result, Task
from nestling.server.broker import EmbeddedBroker
from nestling.server.clock import WallClock
from nestling.server.coordinator import Coordinator, RoundPolicy
from nestling.server.mqtt_transport import MqttTransport, TransportSettings
from nestling.server.registry import DeviceRegistry
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.wire.chunking import encode_chunk_request, split_into_chunks
from nestling.wire.client import connect_and_wait, make_client
from nestling.wire.codec import CHUNK_KIND, encode_message, pack_frame
from nestling.wire.fleet_messages import DeviceStatus, encode_hello, encode_result, encode_status
from nestling.wire.topics import OFFLINE, QOS, FleetTopics
from tests.server.fleet_harness import FakeDevice, echo_result, state_copy, wait_until

FLEET = "fuzz"
Unit = list[tuple[str, bytes]]  # one hostile message: the publishes it takes (several for a chunked one)


def broken(task: Task, rng: random.Random) -> Result:
    """A well-formed result that is wrong in one of the ways a faulty or hostile device gets it wrong."""
    result = echo_result(task)
    first = next(k for k, v in task.weights.items() if v.is_floating_point())
    choice = rng.randrange(9)
    if choice == 0:
        result.weights[first] = torch.zeros(3, 1)
    elif choice == 1:
        result.weights[first] = result.weights[first].double()
    elif choice == 2:
        result.weights["backdoor.weight"] = torch.ones(4)
    elif choice == 3:
        result.weights[first] = torch.full_like(result.weights[first], float("nan"))
    elif choice == 4:
        result.weights[first] = torch.full_like(result.weights[first], float("-inf"))
    elif choice == 5:
        result.round = task.round + rng.randrange(1, 5)
    elif choice == 6:
        result.task_id = f"r0-{rng.randrange(10**6)}"
    elif choice == 7:
        result.spec_id = "0" * 12
    else:
        result.device_id = "someone-else"
    return result


def hostile_messages(tasks: dict[str, tuple[Task, str]], seed: int = 0) -> Iterator[Unit]:
    rng = random.Random(seed)
    topics = FleetTopics(FLEET)
    boards = sorted(tasks)
    poisoned = {}  # per board: a frame invalid twice over (foreign session and NaN), to mutate at random
    for board, (task, _) in tasks.items():
        bad = echo_result(task)
        bad.weights = {
            k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
            for k, v in bad.weights.items()
        }
        poisoned[board] = encode_result(bad, "not-this-server")

    def result_topic() -> tuple[str, str]:
        board = rng.choice(boards)
        return board, topics.result(board)

    for _ in range(150):  # noise
        yield [(result_topic()[1], rng.randbytes(rng.randrange(0, 2000)))]
    for _ in range(150):  # truncations
        board, topic = result_topic()
        frame = poisoned[board]
        yield [(topic, frame[: rng.randrange(0, len(frame))])]
    for _ in range(200):  # bit flips anywhere: preamble, header, body
        board, topic = result_topic()
        frame = bytearray(poisoned[board])
        for _ in range(rng.randrange(1, 4)):
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        yield [(topic, bytes(frame))]
    for _ in range(120):  # well-formed but wrong for the task, or answering another server
        board, topic = result_topic()
        task, session = tasks[board]
        yield [(topic, encode_result(broken(task, rng), session if rng.random() < 0.8 else "old-session"))]
    for _ in range(40):  # unknown schema and frame versions
        board, topic = result_topic()
        frame = bytearray(pack_frame("result", {"round": 0, "device_id": board, "meta": {}}))
        if rng.random() < 0.5:
            frame[4] = rng.randrange(2, 256)
        else:
            frame = bytearray(
                bytes(frame).replace(b'"schema":1', f'"schema":{rng.randrange(2, 10)}'.encode())
            )
        yield [(topic, bytes(frame))]
    for _ in range(20):  # oversized: far beyond what the task's slice can be
        board, topic = result_topic()
        yield [
            (
                topic,
                encode_message(
                    "result", {"round": 0, "device_id": board, "meta": {}}, {"x": torch.zeros(600_000)}
                ),
            )
        ]
    for index in range(50):  # whole chunked transfers of bad results
        board, topic = result_topic()
        task, session = tasks[board]
        payload = encode_result(broken(task, rng), session)
        yield [(topic, chunk) for chunk in split_into_chunks(f"hostile-{index}", payload, 1024)]
    for index in range(80):  # chunks whose layout lies (count, size, index), each its own transfer
        board, topic = result_topic()
        header = {
            "transfer_id": f"lying-{index}",
            "index": rng.randrange(5, 50),
            "count": rng.randrange(1, 5),
            "chunk_size": 1024,
            "total_length": rng.randrange(0, 5000),
            "payload_sha256": "0" * 64,
        }
        yield [(topic, pack_frame(CHUNK_KIND, header, rng.randbytes(rng.randrange(1, 1024))))]
    for index in range(50):  # re-requests for transfers never sent to the asker
        yield [(result_topic()[1], encode_chunk_request(f"never-{index}", [rng.randrange(100)]))]
    for index in range(100):  # results from devices that never registered
        intruder = f"intruder-{index % 7}"
        task, session = tasks[boards[0]]
        yield [(topics.result(intruder), encode_result(echo_result(task, device_id=intruder), session))]
    for _ in range(100):  # unusable hellos
        board = rng.choice(boards)
        profile = rng.choice(
            [
                {},
                {"num_samples": -1},
                {"num_samples": "many"},
                {"num_samples": 5, "labels": "all"},
                {"num_samples": 5, "memory_budget_bytes": 0},
                {"num_samples": 5, "index": -3},
                {"num_samples": True},
            ]
        )
        payload = rng.choice(
            [
                encode_hello(board, profile),
                encode_hello("someone-else", {"num_samples": 3}),
                rng.randbytes(rng.randrange(0, 300)),
            ]
        )
        yield [(topics.hello(board), payload)]
    for _ in range(100):  # unusable heartbeats
        board = rng.choice(boards)
        payload = rng.choice(
            [
                rng.randbytes(rng.randrange(1, 300)),
                encode_message("status", {"device_id": board, "meta": {"state": "dancing", "resources": {}}}),
                encode_status(DeviceStatus("someone-else", "online", 0, {})),
            ]
        )
        yield [(topics.status(board), payload)]
    for name in ("..", "-" * 65):  # device ids no legal device can have
        for _ in range(10):
            yield [(f"nestling/{FLEET}/devices/{name}/result", rng.randbytes(64))]


def rejected(transport: MqttTransport) -> int:
    return sum(v for k, v in transport.counters.items() if k.startswith("rejected_"))


@pytest.fixture
def running_server():
    with EmbeddedBroker() as broker:
        ctx = StrategyContext(
            arch="tinycnn", num_classes=10, in_channels=1, image_size=16, num_clients=3, total_rounds=2
        )
        strategy = create_strategy("nefl-wd", ctx)
        topics = FleetTopics(FLEET)
        client = make_client("fuzz-server", will=(topics.server_status, OFFLINE, True))
        transport = MqttTransport(
            client,
            topics,
            DeviceRegistry(),
            WallClock(),
            TransportSettings(chunk_size=1024, device_wait_s=10, rehello_every_s=0.0),
        )
        transport.connect(broker.host, broker.port)
        # board-2 never answers: a refused result is its board's answer and would close the round at once, so
        # it keeps round 0 open while the hostile frames for board-0's and board-1's tasks are judged
        boards = [FakeDevice(broker.host, broker.port, FLEET, f"board-{i}") for i in range(3)]
        for index, board in enumerate(boards):
            board.hello(index=index, tier=4 * index)
        transport.wait_for_devices(3, 10)
        policy = RoundPolicy(rounds=2, fraction=1.0, quorum=1.0, deadline_s=120.0)
        coordinator = Coordinator(strategy, transport, WallClock(), None, policy)
        yield broker, strategy, transport, boards, coordinator
        for board in boards:
            board.close()
        transport.close()


def test_hostile_messages_are_all_refused_and_the_global_model_is_unchanged(running_server):
    broker, strategy, transport, boards, coordinator = running_server
    before = state_copy(strategy.state_tensors())
    fuzzer = make_client("fuzzer")
    connect_and_wait(fuzzer, broker.host, broker.port)
    with ThreadPoolExecutor(1) as pool:
        round_zero = pool.submit(coordinator.run_round, 0)
        tasks = {board.device_id: board.next_task() for board in boards}
        units = list(hostile_messages({k: v for k, v in tasks.items() if k != "board-2"}))
        assert len(units) >= 1000
        for unit in units:
            for topic, payload in unit:
                fuzzer.publish(topic, payload, qos=QOS).wait_for_publish(5)
        wait_until(lambda: rejected(transport) >= len(units), 60, f"{len(units)} rejections")
        for board in boards:  # the honest boards leave without answering: the round closes at once
            board.publish("status", OFFLINE, retain=True)
        record = round_zero.result(timeout=60)
    fuzzer.disconnect()
    assert rejected(transport) == len(units)
    assert transport.counters["accepted"] == 0 and transport.counters["rejected_internal_error"] == 0
    assert record.accepted == 0 and not record.aggregated
    after = strategy.state_tensors()
    assert all(torch.equal(before[k], after[k]) for k in before)
    reasons = {k for k, v in transport.counters.items() if k.startswith("rejected_") and v}
    assert {
        "rejected_malformed",
        "rejected_sha_mismatch",
        "rejected_unknown_schema",
        "rejected_oversized",
        "rejected_wrong_tensors",
        "rejected_non_finite",
        "rejected_future",
        "rejected_unknown_task",
        "rejected_wrong_device",
        "rejected_stale_session",
        "rejected_unknown_device",
    } <= reasons

    # Still serving: honest boards come back and their results of the next round are applied.
    for index, board in enumerate(boards):
        board.hello(index=index, tier=4 * index)
    # Registration is asynchronous: start the round only once the server sees every board again.
    wait_until(lambda: len(transport.devices()) == len(boards), 30, "the boards to register again")
    with ThreadPoolExecutor(1) as pool:
        round_one = pool.submit(coordinator.run_round, 1)
        for board in boards:
            task, session = board.next_task()
            board.send_result(echo_result(task), session)
        assert round_one.result(timeout=60).accepted == 3
    assert transport.counters["accepted"] == 3
