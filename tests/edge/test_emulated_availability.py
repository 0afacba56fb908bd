"""An emulated board that comes and goes by its trace: it really leaves the broker, loses the task it held, and
registers again when its next window opens; and the interruption rules on their own."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import pytest
import torch

from nestling.edge.agent import Agent
from nestling.edge.agent_cli import agent_main, apply_emulation_flags, resolve_emulation, with_availability
from nestling.edge.agent_config import agent_config_from_dict
from nestling.edge.emulated_availability import TaskInterruption
from nestling.edge.procedures import ClientData
from nestling.errors import ConfigError
from nestling.profiler.traces import DeviceTrace, save_traces
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.server.strategies.base import DeviceInfo
from nestling.wire.chunking import split_into_chunks
from nestling.wire.fleet_messages import ServerStatus, encode_server_status, encode_task
from nestling.wire.topics import OFFLINE
from tests.edge.test_agent_emulation import FLEET, Server, broker  # noqa: F401  (the module's broker fixture)

DEVICE = "flaky-1"
# Online for the first 1.5 trace hours, away until 3 h, then for good; slow enough that a task outlives the window.
FLAKY = DeviceTrace(
    "flaky-pi",
    "rpi3b",
    2**30,
    up_bps=1e8,
    down_bps=1e8,
    latency_s=0.01,
    gflops=0.05,
    availability=((0.0, 5400.0), (10800.0, 1e12)),
)
SCALE = 7200.0  # two trace hours a wall second


def test_an_interruption_stops_only_its_own_task() -> None:
    stopping = threading.Event()
    cut = TaskInterruption(stopping)
    assert cut.begin(3, time.monotonic(), "s1") is None
    cut.round_closed(2, "s1")  # an older round closing is not ours
    cut.round_closed(3, "s0")  # nor is another server session's round 3 (a retained status of an earlier run)
    assert not cut.interrupted and cut.sleep(0.01) is False
    cut.round_closed(3, "s1")
    assert cut.interrupted and cut.reason == "its round closed"
    started = time.monotonic()
    assert cut.sleep(5.0) is True and time.monotonic() - started < 0.5  # the pacer's sleep is cut short
    cut.end()
    assert cut.begin(3, time.monotonic(), "s1") == "its round closed"  # a queued task of a closed round
    assert cut.begin(3, time.monotonic(), "s2") is None  # a new server session starts its rounds afresh
    cut.end()
    received = time.monotonic()
    assert cut.begin(4, received, "s1") is None
    cut.departed()
    assert cut.reason is not None and "left" in cut.reason
    cut.end()
    assert cut.begin(5, received, "s1") == "it arrived before the board left"
    assert cut.begin(5, time.monotonic() + 1e-3, "s1") is None


def test_availability_needs_a_trace_device_and_a_positive_scale(tmp_path: Path) -> None:
    save_traces([FLAKY], tmp_path / "t.jsonl")
    config = agent_config_from_dict(
        {"broker": {"url": "mqtt://127.0.0.1:1", "fleet": FLEET}, "device": {"id": "x"}}
    )
    with pytest.raises(ConfigError, match="needs --emulate-trace"):
        with_availability(None, config.device, 1.0)
    apply_emulation_flags(config, None, tmp_path / "t.jsonl", "flaky-pi")
    target = resolve_emulation(config.device)
    with pytest.raises(ConfigError, match="time scale.*> 0"):
        with_availability(target, config.device, -2.0)
    scaled = with_availability(target, config.device, SCALE)
    assert scaled is not None and scaled.availability.availability == ((0.0, 0.75), (1.5, 1e12 / SCALE))
    assert target is not None and target.availability is None  # off unless asked for


def test_the_time_scale_alone_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    save_traces([FLAKY], tmp_path / "t.jsonl")
    (tmp_path / "agent.toml").write_text(
        f'[broker]\nurl = "mqtt://127.0.0.1:1"\nfleet = "{FLEET}"\n[device]\nid = "x"\n'
    )
    argv = ["--config", str(tmp_path / "agent.toml"), "--emulate-trace", str(tmp_path / "t.jsonl")]
    assert agent_main([*argv, "--emulate-device", "flaky-pi", "--emulate-time-scale", "60"]) == 2
    assert "give --emulate-availability too" in capsys.readouterr().err


def test_a_flaky_board_leaves_loses_its_task_and_returns(broker, tmp_path: Path) -> None:  # noqa: F811
    server = Server(broker.host, broker.port)
    server.client.subscribe(server.topics.status(DEVICE), 1)
    save_traces([FLAKY], tmp_path / "flaky.jsonl")
    config = agent_config_from_dict(
        {
            "broker": {"url": broker.url, "fleet": FLEET},
            "device": {
                "id": DEVICE,
                "emulate_trace": str(tmp_path / "flaky.jsonl"),
                "emulate_device": "flaky-pi",
            },
            "agent": {"heartbeat_s": 0.3, "chunk_kb": 64},
        }
    )
    emulation = with_availability(resolve_emulation(config.device), config.device, SCALE)
    data = ClientData(
        torch.randn(30, 1, 16, 16, generator=torch.Generator().manual_seed(0)), torch.arange(30) % 10
    )
    agent = Agent(config, data, emulation=emulation).start()
    try:
        server.next("hello")
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
        announced = time.monotonic()  # the first training round starts the trace's clock
        server.publish(
            server.topics.server_status, encode_server_status(ServerStatus("s1", "training", 0)), retain=True
        )
        for chunk in split_into_chunks("task-flaky", encode_task(task, "s1"), 64 * 1024):
            server.publish(server.topics.task(DEVICE), chunk)
        # The board trains at 0.05 GFLOP/s: its task needs far longer than the 0.75 s its window has left.
        offline_at = _next_status(server, lambda p: p == OFFLINE) - announced
        assert 0.7 < offline_at < 1.7, offline_at
        _, hello_at = server.next("hello", timeout=10.0)  # back at trace hour 3 (1.5 s), registering again
        assert 1.45 < hello_at - announced < 3.0, hello_at - announced
        with pytest.raises(queue.Empty):  # the abandoned task's result never comes
            server.next("result", timeout=1.0)
        assert agent.interruption is not None and agent.interruption.left_at > announced
        assert agent.availability is not None and agent.availability.departures == 1
    finally:
        agent.stop()
        server.close()


def _next_status(server: Server, match) -> float:
    """When the next status the device published matched `match` (the server's clock)."""
    give_up = time.monotonic() + 10.0
    while time.monotonic() < give_up:
        channel, payload, at = server.inbox.get(timeout=max(0.01, give_up - time.monotonic()))
        if channel == "status" and match(bytes(payload)):
            return at
    raise AssertionError("no matching status")


class RecordingLink:
    """Stands in for AgentLink's two calls the schedule makes; the real link is exercised above."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []
        self.started = time.monotonic()

    def leave(self) -> None:
        self.calls.append(("leave", time.monotonic() - self.started))

    def start(self) -> None:
        self.calls.append(("start", time.monotonic() - self.started))


def test_the_schedule_skips_empty_windows_and_ends_online_for_good() -> None:
    from nestling.edge.emulated_availability import EmulatedAvailability

    trace = DeviceTrace(
        "t",
        "rpi3b",
        2**30,
        1e6,
        1e6,
        0.0,
        gflops=1.0,
        availability=((0.0, 0.2), (0.3, 0.3), (0.45, 0.6), (0.8, 1e12)),  # (0.3, 0.3): an instant, skipped
    )
    stopping = threading.Event()
    link = RecordingLink()
    follow = EmulatedAvailability(trace, link, TaskInterruption(stopping), stopping)  # type: ignore[arg-type]
    follow.on_announcement("waiting")
    assert follow.epoch is None  # only a training round starts the clock
    follow.on_announcement("training")
    time.sleep(1.2)
    stopping.set()
    assert [kind for kind, _ in link.calls] == ["leave", "start", "leave", "start"]
    for (_, at), expected in zip(link.calls, (0.2, 0.45, 0.6, 0.8), strict=True):
        assert expected - 0.01 < at < expected + 0.15, link.calls
    assert follow.departures == 2 and not follow.away
