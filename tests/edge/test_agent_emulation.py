"""`nestling agent --emulate`: config and flags, and a real agent on a real broker that takes as long as the board."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import pytest
import torch

from nestling.edge.agent import Agent
from nestling.edge.agent_cli import agent_main, apply_emulation_flags, resolve_emulation
from nestling.edge.agent_config import DeviceSection, agent_config_from_dict, load_agent_config
from nestling.edge.emulation import EmulationTarget
from nestling.edge.procedures import ClientData
from nestling.errors import ConfigError
from nestling.profiler.catalogue import BOARDS, get_board
from nestling.profiler.speed import SpeedFigures
from nestling.profiler.traces import DeviceTrace, save_traces
from nestling.server.broker import EmbeddedBroker
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.server.strategies.base import DeviceInfo
from nestling.simulator.durations import TraceDurations
from nestling.wire.chunking import split_into_chunks
from nestling.wire.client import connect_and_wait, make_client
from nestling.wire.codec import CHUNK_KIND, decode_message, read_header
from nestling.wire.fleet_messages import (
    ServerStatus,
    decode_hello,
    decode_result,
    encode_server_status,
    encode_task,
)
from nestling.wire.topics import QOS, FleetTopics, parse_topic
from nestling.wire.transfers import Inbound

FLEET = "emul"
DEVICE = "slow-1"
SLOW = DeviceTrace("slow-pi", "rpi4", 2**30, up_bps=2e6, down_bps=4e6, latency_s=0.05, gflops=0.1)


def write_trace(path: Path) -> Path:
    fast = DeviceTrace("fast-pi", "rpi4", 2**30, up_bps=1e8, down_bps=1e8, latency_s=0.01, gflops=50.0)
    measured = DeviceTrace(
        "measured", "fedscale", 2**30, up_bps=1e6, down_bps=1e6, latency_s=0.0, block_latency_s={"*": 0.01}
    )
    save_traces([SLOW, fast, measured], path)
    return path


# -- config and flags ----------------------------------------------------------------------------------------
def test_device_emulate_names_a_catalogue_class() -> None:
    config = agent_config_from_dict({"device": {"id": "b", "emulate": "rpi4"}})
    target = resolve_emulation(config.device)
    rpi4 = get_board("rpi4")
    assert target == EmulationTarget(
        "rpi4",
        SpeedFigures(rpi4.sustained_gflops, rpi4.up_bps, rpi4.down_bps, rpi4.latency_s),
        memory_bytes=rpi4.memory_budget_bytes,  # the class's training memory: its profile reports it
    )
    assert resolve_emulation(agent_config_from_dict({"device": {"id": "b"}}).device) is None


def test_an_unknown_class_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown board class 'pi9'") as error:
        resolve_emulation(DeviceSection(id="b", emulate="pi9"))
    assert all(name in str(error.value) for name in BOARDS)


def test_a_trace_device_brings_its_own_figures(tmp_path: Path) -> None:
    write_trace(tmp_path / "fleet.jsonl")
    (tmp_path / "agent.toml").write_text(
        '[device]\nid = "b"\nemulate_trace = "fleet.jsonl"\nemulate_device = "slow-pi"\n'
    )
    config = load_agent_config(tmp_path / "agent.toml")
    assert config.device.emulate_trace == str(tmp_path / "fleet.jsonl")  # relative to the config file
    target = resolve_emulation(config.device)
    assert target is not None and target.memory_bytes is not None  # the trace device's budget
    assert target == EmulationTarget(
        "rpi4", SpeedFigures(0.1, 2e6, 4e6, 0.05), trace_device="slow-pi", memory_bytes=target.memory_bytes
    )
    with pytest.raises(
        ConfigError, match=r"no device 'nope' in trace .*\(it has 3: slow-pi, fast-pi, measured\)"
    ):
        resolve_emulation(
            DeviceSection(id="b", emulate_trace=str(tmp_path / "fleet.jsonl"), emulate_device="nope")
        )
    measured = resolve_emulation(
        DeviceSection(id="b", emulate_trace=str(tmp_path / "fleet.jsonl"), emulate_device="measured")
    )  # paced by its measured latency
    assert measured.figures.sustained_gflops is None and measured.figures.block_latency_s


def test_config_keys_go_together_and_flags_override_them(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="exclude each other"):
        agent_config_from_dict(
            {"device": {"id": "b", "emulate": "rpi4", "emulate_trace": "t.jsonl", "emulate_device": "x"}}
        )
    with pytest.raises(ConfigError, match="go together"):
        agent_config_from_dict({"device": {"id": "b", "emulate_trace": "t.jsonl"}})
    config = agent_config_from_dict({"device": {"id": "b", "emulate": "rpi4"}})
    apply_emulation_flags(config, None, tmp_path / "t.jsonl", "dev-3")
    assert (config.device.emulate, config.device.emulate_trace, config.device.emulate_device) == (
        None,
        str(tmp_path / "t.jsonl"),
        "dev-3",
    )
    apply_emulation_flags(config, "phone-low", None, None)
    assert (config.device.emulate, config.device.emulate_trace, config.device.emulate_device) == (
        "phone-low",
        None,
        None,
    )
    apply_emulation_flags(config, None, None, None)  # no flags: the config stands
    assert config.device.emulate == "phone-low"
    with pytest.raises(ConfigError, match="exclude each other"):
        apply_emulation_flags(config, "rpi4", tmp_path / "t.jsonl", "dev-3")
    with pytest.raises(ConfigError, match="go together"):
        apply_emulation_flags(config, None, tmp_path / "t.jsonl", None)


def test_nestling_agent_stops_at_once_on_an_unknown_class(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "agent.toml").write_text('[broker]\nurl = "mqtt://127.0.0.1:1"\n[device]\nid = "b"\n')
    assert agent_main(["--config", str(tmp_path / "agent.toml"), "--emulate", "pi9"]) == 2
    err = capsys.readouterr().err
    assert "unknown board class 'pi9'" in err and "rpi4" in err and "phone-low" in err


# -- a real agent on a real broker ---------------------------------------------------------------------------
class Server:
    """The server's side of the protocol, by hand: hello in, a chunked task out, the result back (timed)."""

    def __init__(self, host: str, port: int) -> None:
        self.topics = FleetTopics(FLEET)
        self.inbox: queue.Queue = queue.Queue()
        self.client = make_client(f"emul-server-{time.monotonic_ns()}")
        self.client.on_message = lambda _c, _u, m: self.inbox.put(
            (parse_topic(m.topic).channel, m.payload, time.monotonic())
        )
        connect_and_wait(self.client, host, port)
        self.client.subscribe([(self.topics.all_devices(c), QOS) for c in ("hello", "result")])
        time.sleep(0.2)

    def next(self, channel: str, timeout: float = 30.0) -> tuple[bytes, float]:
        give_up = time.monotonic() + timeout
        while True:
            got, payload, at = self.inbox.get(timeout=max(0.01, give_up - time.monotonic()))
            if got == channel:
                return payload, at

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=QOS, retain=retain).wait_for_publish(5)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture(scope="module")
def broker():
    with EmbeddedBroker() as running:
        yield running


def test_an_emulated_slow_board_takes_at_least_what_the_replay_predicts(broker, tmp_path: Path) -> None:
    server = Server(broker.host, broker.port)
    config = agent_config_from_dict(
        {
            "broker": {"url": broker.url, "fleet": FLEET},
            "device": {
                "id": DEVICE,
                "emulate_trace": str(write_trace(tmp_path / "fleet.jsonl")),
                "emulate_device": "slow-pi",
            },
            "agent": {"heartbeat_s": 0.5, "chunk_kb": 4},
        }
    )
    data = ClientData(
        torch.randn(30, 1, 16, 16, generator=torch.Generator().manual_seed(0)), torch.arange(30) % 10
    )
    agent = Agent(config, data, emulation=resolve_emulation(config.device)).start()
    try:
        _, profile = decode_hello(server.next("hello")[0])
        assert profile["emulating"] == {
            "class": "rpi4",
            "trace_device": "slow-pi",
            "gflops": 0.1,
            "up_bps": 2e6,
            "down_bps": 4e6,
            "latency_s": 0.05,
        }
        ctx = StrategyContext(
            arch="tinycnn",
            num_classes=10,
            in_channels=1,
            image_size=16,
            num_clients=1,
            total_rounds=1,
            local={"local_epochs": 1, "batch_size": 8},
        )
        task = create_strategy("fedavg", ctx).assign(0, [DeviceInfo(DEVICE, 0, 30)])[DEVICE]
        predicted = TraceDurations({DEVICE: SLOW}, {DEVICE: 30}, (1, 16, 16)).cost(task)
        assert 0.5 < predicted.total_s < 3.0 and predicted.compute_s > 0.5  # each phase is felt
        server.publish(
            server.topics.server_status, encode_server_status(ServerStatus("s1", "training", 0)), retain=True
        )
        server.next("hello")  # the agent greets the new server session
        chunks = split_into_chunks("task-emul", encode_task(task, "s1"), 4096)
        assert len(chunks) > 1
        sent_at = time.monotonic()
        for chunk in chunks:
            server.publish(server.topics.task(DEVICE), chunk)
        inbound = Inbound(64 * 1024 * 1024)
        while True:
            payload, arrived = server.next("result")
            if read_header(payload)["kind"] == CHUNK_KIND:
                payload = inbound.add(payload)
                if payload is None:
                    continue
            break
        took = arrived - sent_at
        result = decode_result(decode_message(payload))[0]
        assert result.task_id == task.task_id
        assert result.metrics["emulated"] == "rpi4"
        assert result.metrics["emulated_compute_s"] == pytest.approx(predicted.compute_s)
        assert result.metrics["emulated_down_s"] == pytest.approx(predicted.down_s)
        assert took >= predicted.total_s, (took, predicted)  # never faster than the board
        assert took < predicted.total_s + 2.0, (took, predicted)  # padded once, not twice
    finally:
        agent.stop()
        server.close()
