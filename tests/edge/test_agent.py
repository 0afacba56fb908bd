"""The edge agent against a scripted server on a real broker: hello, chunked tasks, results, recovery paths."""

from __future__ import annotations

import queue
import time

import pytest
import torch

import nestling.edge.trainer
from nestling.edge.agent import Agent
from nestling.edge.agent_config import agent_config_from_dict
from nestling.edge.procedures import ClientData
from nestling.errors import ConfigError
from nestling.server.broker import EmbeddedBroker
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.server.strategies.base import DeviceInfo
from nestling.spec import SubmodelSpec
from nestling.wire.chunking import decode_chunk_request, encode_chunk_request, split_into_chunks
from nestling.wire.client import connect_and_wait, make_client
from nestling.wire.codec import CHUNK_KIND, CHUNK_REQUEST_KIND, decode_message, read_header
from nestling.wire.fleet_messages import (
    ServerStatus,
    decode_hello,
    decode_result,
    encode_rehello,
    encode_server_status,
    encode_task,
)
from nestling.wire.topics import OFFLINE, QOS, FleetTopics, parse_topic
from nestling.wire.transfers import Inbound

FLEET = "edge"
DEVICE = "board-7"


class ScriptedServer:
    """Plays the server's side of the protocol by hand."""

    def __init__(self, host: str, port: int) -> None:
        self.topics = FleetTopics(FLEET)
        self.inbox: queue.Queue = queue.Queue()
        self.inbound = Inbound(64 * 1024 * 1024)
        self.client = make_client(f"scripted-{time.monotonic_ns()}")
        self.client.on_message = lambda _c, _u, m: self.inbox.put((self._channel(m.topic), m.payload))
        connect_and_wait(self.client, host, port)
        self.client.subscribe([(self.topics.all_devices(c), QOS) for c in ("hello", "status", "result")])
        self.publish(self.topics.server_status, b"", retain=True)  # forget the previous test's server
        time.sleep(0.2)

    @staticmethod
    def _channel(topic: str) -> str:
        parsed = parse_topic(topic)
        return parsed.channel if parsed.device_id is not None else "server"

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=QOS, retain=retain).wait_for_publish(5)

    def announce(self, session: str, phase: str = "training", round_index: int = 0) -> None:
        self.publish(
            self.topics.server_status,
            encode_server_status(ServerStatus(session, phase, round_index)),
            retain=True,
        )

    def next(self, channel: str, timeout: float = 20.0) -> bytes:
        give_up = time.monotonic() + timeout
        while True:
            got, payload = self.inbox.get(timeout=max(0.01, give_up - time.monotonic()))
            if got == channel:
                return payload

    def next_result(self, timeout: float = 30.0):
        while True:
            payload = self.next("result", timeout)
            kind = read_header(payload)["kind"]
            if kind == CHUNK_REQUEST_KIND:
                return decode_chunk_request(payload)
            if kind == CHUNK_KIND:
                payload = self.inbound.add(payload)
                if payload is None:
                    continue
            return decode_result(decode_message(payload))[0]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture(scope="module")
def broker():
    with EmbeddedBroker() as running:
        yield running


@pytest.fixture
def server(broker):
    made = ScriptedServer(broker.host, broker.port)
    yield made
    made.close()


@pytest.fixture
def agent(broker, server):
    config = agent_config_from_dict(
        {
            "broker": {"url": broker.url, "fleet": FLEET},
            "device": {"id": DEVICE, "memory_budget_mb": 48},
            "data": {"client_index": 2, "num_clients": 4},
            "agent": {"heartbeat_s": 0.5, "chunk_kb": 1, "stall_s": 0.3},
        }
    )
    generator = torch.Generator().manual_seed(0)
    data = ClientData(torch.randn(40, 1, 16, 16, generator=generator), torch.arange(40) % 10)
    made = Agent(config, data).start()
    yield made
    made.stop()


@pytest.fixture
def small_task():
    ctx = StrategyContext(
        arch="tinycnn",
        num_classes=10,
        in_channels=1,
        image_size=16,
        num_clients=4,
        total_rounds=3,
        local={"local_steps": 2, "batch_size": 8},
    )
    strategy = create_strategy("nefl-wd", ctx)
    device = DeviceInfo(DEVICE, 2, 40, tier=0)
    return strategy.assign(0, [device])[DEVICE], strategy


def test_the_agent_says_hello_with_its_profile(agent, server):
    sender, profile = decode_hello(server.next("hello"))
    assert sender == DEVICE
    assert profile["num_samples"] == 40 and profile["labels"] == list(range(10)) and profile["index"] == 2
    assert profile["memory_budget_bytes"] == 48 * 1024 * 1024
    assert profile["torch_version"] == torch.__version__ and profile["cores"] >= 1


def test_a_chunked_task_with_a_lost_chunk_is_trained_as_the_small_slice_only(
    agent, server, small_task, monkeypatch
):
    task, strategy = small_task
    built: list[SubmodelSpec] = []
    real_build = nestling.edge.trainer.build
    monkeypatch.setattr(
        nestling.edge.trainer, "build", lambda spec, **kw: built.append(spec) or real_build(spec, **kw)
    )
    server.next("hello")
    server.announce("s1")
    chunks = split_into_chunks("task-1", encode_task(task, "s1"), 1024)
    for index, chunk in enumerate(chunks):
        if index != 2:  # lost on the way: the agent must ask for exactly this one
            server.publish(server.topics.task(DEVICE), chunk)
    request = server.next_result()
    assert request.transfer_id == "task-1" and request.indices == (2,)
    server.publish(server.topics.task(DEVICE), chunks[2])
    result = server.next_result()
    assert result.task_id == task.task_id and result.round == 0
    assert {k: v.shape for k, v in result.weights.items()} == {k: v.shape for k, v in task.weights.items()}
    assert any(v.numel() < strategy.global_state[k].numel() for k, v in result.weights.items())
    assert [spec.id for spec in built] == [task.spec_id] and built[0].width < 1.0  # never the full model
    assert result.metrics["train_seconds"] > 0 and result.metrics["peak_memory_bytes"] >= 0
    assert result.metrics["loss_mean"] is not None and result.num_samples == 40


def test_lost_result_chunks_are_resent_and_a_repeated_task_is_answered_without_training(
    agent, server, small_task, monkeypatch
):
    task, _ = small_task
    server.next("hello")
    server.announce("s2")
    server.publish(server.topics.task(DEVICE), encode_task(task, "s2"))
    first_chunk = server.next("result")
    transfer = read_header(first_chunk)["transfer_id"]
    server.inbound.add(first_chunk)
    server.next_result()  # the rest of the chunks
    server.publish(server.topics.ctrl(DEVICE), encode_chunk_request(transfer, [0, 1]))
    resent = [server.next("result") for _ in range(2)]
    assert [read_header(c)["index"] for c in resent] == [0, 1]
    calls: list[str] = []
    monkeypatch.setattr("nestling.edge.agent_training.run_task", lambda *a, **k: calls.append("trained"))
    server.inbound = Inbound(64 * 1024 * 1024)
    server.publish(server.topics.task(DEVICE), encode_task(task, "s2"))  # the server lost our answer
    assert server.next_result().task_id == task.task_id and calls == []


def test_a_new_server_session_or_a_rehello_request_makes_the_agent_register_again(agent, server):
    server.next("hello")  # on connect
    server.announce("first")
    assert decode_hello(server.next("hello"))[0] == DEVICE  # greets the server process it just learned of
    server.announce("first")  # the same server again (a phase change): no new hello
    server.announce("second")  # the server restarted: it knows no one
    assert decode_hello(server.next("hello"))[0] == DEVICE
    with pytest.raises(queue.Empty):
        server.next("hello", timeout=0.5)
    server.publish(server.topics.ctrl(DEVICE), encode_rehello("second"))
    assert decode_hello(server.next("hello"))[0] == DEVICE


def test_heartbeats_are_retained_status_messages(agent, server):
    beats = []
    while len(beats) < 3:
        status = server.next("status")
        if status != OFFLINE:  # the previous test's agent said goodbye on the same (retained) topic
            beats.append(read_header(status))
    assert all(b["kind"] == "status" and b["device_id"] == DEVICE for b in beats)


def test_agent_config_errors_name_the_key():
    with pytest.raises(
        ConfigError, match=r"\[device\] tier: a board no longer picks its own tier.*\[enrolment\]"
    ):
        agent_config_from_dict({"device": {"id": "a", "tier": 1}})
    with pytest.raises(ConfigError, match="client_index"):
        agent_config_from_dict({"device": {"id": "a"}, "data": {"client_index": 4, "num_clients": 4}})
    with pytest.raises(ConfigError, match="unknown keys"):
        agent_config_from_dict({"device": {"id": "a", "colour": "red"}})
    with pytest.raises(ConfigError, match="TLS"):
        agent_config_from_dict({"broker": {"url": "mqtts://broker:8883"}, "device": {"id": "a"}})
    with pytest.raises(ConfigError, match="device"):
        agent_config_from_dict({"device": {"id": "a/b"}})


def _train_once_with_a_state_file(
    broker, server, tmp_path, method: str, local: dict, options: dict, session: str
):
    """An agent with `[device] state_file` trains one task of `method`; (agent config, data, the stopped agent,
    the task, the result it sent)."""
    config = agent_config_from_dict(
        {
            "broker": {"url": broker.url, "fleet": FLEET},
            "device": {"id": DEVICE, "memory_budget_mb": 48, "state_file": "state/store.safetensors"},
            "agent": {"heartbeat_s": 0.5},
        },
        base=tmp_path,
    )
    ctx = StrategyContext(
        arch="tinycnn",
        num_classes=10,
        in_channels=1,
        image_size=16,
        num_clients=4,
        total_rounds=3,
        local=local,
        options=options,
    )
    task = create_strategy(method, ctx).assign(0, [DeviceInfo(DEVICE, 3, 40)])[DEVICE]
    data = ClientData(
        torch.randn(40, 1, 16, 16, generator=torch.Generator().manual_seed(0)), torch.arange(40) % 10
    )
    first = Agent(config, data).start()
    try:
        server.next("hello")
        server.announce(session)
        for chunk in split_into_chunks(f"task-{session}", encode_task(task, session), 64 * 1024):
            server.publish(server.topics.task(DEVICE), chunk)
        result = server.next_result()
    finally:
        first.stop()
    return config, data, first, task, result


def test_the_device_store_survives_an_agent_restart_with_a_state_file(broker, server, tmp_path):
    from nestling.edge.procedures.feddyn import STORE_KEY

    config, data, first, task, result = _train_once_with_a_state_file(
        broker,
        server,
        tmp_path,
        "depthfl",
        {"local_steps": 2, "batch_size": 8},
        {"feddyn_alpha": 0.1},
        "s-state",
    )
    assert result.task_id == task.task_id
    h = first.store[STORE_KEY]
    assert h and any(bool(v.abs().sum() > 0) for v in h.values())  # FedDyn's h_k moved during training
    restarted = Agent(config, data)  # a power cut later: the new process reads the file
    assert set(restarted.store[STORE_KEY]) == set(h)
    assert all(torch.equal(restarted.store[STORE_KEY][k], h[k]) for k in h)


def test_a_dynamicfl_structure_survives_an_agent_restart_with_a_state_file(broker, server, tmp_path):
    """The board's re-parameterised structure ζ_i and salience (METHODS §5.a.6) outlive the agent process."""
    from nestling.methods.dynamicfl import DynamicState

    config, data, first, task, result = _train_once_with_a_state_file(
        broker,
        server,
        tmp_path,
        "dynamicfl",
        {"local_epochs": 2, "batch_size": 8},
        {"capacities": [2]},
        "s-dyn",
    )
    assert task.hparams["capacity"] == 2
    assert result.task_id == task.task_id and set(result.weights) == set(task.weights)  # plain upload
    before = DynamicState.from_store(first.store["dynamicfl"])
    assert len(before.structure) == 2 and before.local_salience
    after = DynamicState.from_store(Agent(config, data).store["dynamicfl"])
    assert after.structure == before.structure and after.local_salience == before.local_salience
    assert after.branches.keys() == before.branches.keys()
