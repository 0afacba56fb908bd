"""Test helpers for attacks on a fleet: honest fake updates, the attacks of issue 16, and a small fleet on a
real mosquitto broker whose boards answer every round with a chosen behaviour."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from nestling.messages import Result, Task
from nestling.server.broker import EmbeddedBroker
from nestling.server.clock import WallClock
from nestling.server.coordinator import Coordinator, RoundPolicy, RoundRecord
from nestling.server.mqtt_transport import MqttTransport, TransportSettings
from nestling.server.registry import DeviceRegistry
from nestling.server.screening import RobustPolicy
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.wire.client import make_client
from nestling.wire.topics import OFFLINE, FleetTopics
from tests.server.fleet_harness import FakeDevice, echo_result, wait_until

Behaviour = Callable[[Task, int], Result]  # (task, board number) -> the result the board sends


def honest(task: Task, board: int) -> Result:
    """A small update seeded by round and board, like one epoch of local SGD would give."""
    generator = torch.Generator().manual_seed(1000 * task.round + board)
    result = echo_result(task)
    for value in result.weights.values():
        if value.is_floating_point():
            value.add_(0.01 * torch.randn(value.shape, generator=generator))
    return result


def huge_values(task: Task, board: int) -> Result:
    """Every weight set to 3.0e38: finite, the right names, shapes and dtypes."""
    result = echo_result(task)
    result.weights = {
        k: torch.full_like(v, 3.0e38) if v.is_floating_point() else v for k, v in result.weights.items()
    }
    return result


def scaled(factor: float) -> Behaviour:
    """An honest update multiplied by `factor` (factor -1: sign-flipped)."""

    def attack(task: Task, board: int) -> Result:
        result = honest(task, board)
        for key, value in result.weights.items():
            if value.is_floating_point():
                base = task.weights[key]
                value.copy_(base + factor * (value - base))
        return result

    return attack


def inflated_samples(task: Task, board: int) -> Result:
    result = honest(task, board)
    result.weights = {k: torch.zeros_like(v) for k, v in result.weights.items()}
    result.num_samples = 10**9  # its hello said 100
    return result


def lying_samples(task: Task, board: int) -> Result:
    """An honest update claiming 10**9 samples, as its hello did (`fleet_server(..., hello_samples=...)`)."""
    result = honest(task, board)
    result.num_samples = 10**9
    return result


@dataclass
class AttackRun:
    records: list[RoundRecord]
    state: dict[str, torch.Tensor]
    transport_counters: dict[str, int]
    coordinator: Coordinator


def small_strategy(method: str = "fedavg", clients: int = 3, rounds: int = 3):
    ctx = StrategyContext(
        arch="tinycnn",
        num_classes=10,
        in_channels=1,
        image_size=16,
        num_clients=clients,
        total_rounds=rounds,
        seed=0,
    )
    return create_strategy(method, ctx)


@contextmanager
def fleet_server(
    broker: EmbeddedBroker,
    fleet: str,
    boards: int,
    rounds: int,
    robust: RobustPolicy | None = None,
    method: str = "fedavg",
    deadline_s: float = 30.0,
    hello_samples: dict[int, int] | None = None,
) -> Iterator[tuple[Coordinator, MqttTransport, list[FakeDevice]]]:
    """A server (real MqttTransport and Coordinator) and `boards` registered fake boards on `broker`; each board's
    hello claims 100 samples unless `hello_samples` says otherwise."""
    topics = FleetTopics(fleet)
    client = make_client(f"{fleet}-server", will=(topics.server_status, OFFLINE, True))
    transport = MqttTransport(
        client,
        topics,
        DeviceRegistry(),
        WallClock(),
        TransportSettings(chunk_size=64 * 1024, device_wait_s=10, rehello_every_s=0.0),
    )
    transport.connect(broker.host, broker.port)
    devices = [FakeDevice(broker.host, broker.port, fleet, f"board-{i}") for i in range(boards)]
    try:
        for index, device in enumerate(devices):
            device.hello(index=index, num_samples=(hello_samples or {}).get(index, 100))
        wait_until(lambda: len(transport.devices()) == boards, 20, "every board to register")
        policy = RoundPolicy(
            rounds=rounds,
            fraction=1.0,
            quorum=0.6,
            deadline_s=deadline_s,
            eval_every=0,
            checkpoint_every=0,
            robust=robust or RobustPolicy(),
        )
        coordinator = Coordinator(
            small_strategy(method, boards, rounds), transport, WallClock(), None, policy
        )
        yield coordinator, transport, devices
    finally:
        for device in devices:
            device.close()
        transport.close()


def play_round(
    coordinator: Coordinator, devices: list[FakeDevice], round_index: int, behaviours: dict[int, Behaviour]
) -> RoundRecord:
    """Run one round: every board that gets a task answers it with its behaviour (honest by default)."""
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(coordinator.run_round, round_index)
        for number, device in enumerate(devices):
            if coordinator.quarantine.get(device.device_id, -1) > round_index:
                continue  # quarantined: the server sends it nothing this round
            task, session = device.next_task()
            device.send_result(behaviours.get(number, honest)(task, number), session)
        return running.result(timeout=60)


def run_fleet(
    broker: EmbeddedBroker,
    fleet: str,
    rounds: int,
    behaviours: dict[int, Behaviour],
    boards: int = 3,
    robust: RobustPolicy | None = None,
    deadline_s: float = 30.0,
    hello_samples: dict[int, int] | None = None,
) -> AttackRun:
    with fleet_server(
        broker, fleet, boards, rounds, robust, deadline_s=deadline_s, hello_samples=hello_samples
    ) as (
        coordinator,
        transport,
        devices,
    ):
        records = [play_round(coordinator, devices, r, behaviours) for r in range(rounds)]
        state = {k: v.clone() for k, v in coordinator.strategy.global_state.items()}
        return AttackRun(records, state, dict(transport.counters), coordinator)


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())
