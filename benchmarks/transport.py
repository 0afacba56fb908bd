"""Fleet transport costs, measured side by side through mosquitto on loopback.

1. A ResNet-18-sized result (44.7 MB fp32) moved with Nestling's chunked transfer (256 KiB chunks,
   per-chunk and whole-payload sha256, reassembly) divided by one raw paho publish of the same bytes
   (goal <= 1.5).
2. Coordination overhead per round: the real coordinator + MqttTransport with 50 agents (one process,
   one paho client each) that train nothing and echo their task's weights (goal <= 1 s per round).

Run: OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.transport
Ends with one line `chunked_over_raw=… round_overhead_s=…`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from nestling.messages import Result
from nestling.models.config import ModelConfig
from nestling.models.zoo import build
from nestling.server.broker import find_free_port, mosquitto_binary, start_mosquitto
from nestling.server.clock import WallClock
from nestling.server.coordinator import Coordinator, RoundPolicy
from nestling.server.mqtt_transport import MqttTransport, TransportSettings
from nestling.server.registry import DeviceRegistry
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.spec import SubmodelSpec
from nestling.wire.client import connect_and_wait, make_client
from nestling.wire.codec import CHUNK_KIND, decode_message, read_header
from nestling.wire.fleet_messages import (
    REHELLO,
    DeviceStatus,
    decode_task,
    encode_hello,
    encode_result,
    encode_status,
)
from nestling.wire.topics import OFFLINE, QOS, FleetTopics
from nestling.wire.transfers import Inbound, Outbound

FLEET = "bench"
REPO = Path(__file__).resolve().parents[1]


def resnet18_result() -> bytes:
    """An encoded Result carrying a full ResNet-18 state (the largest upload of the paper's setups)."""
    spec = SubmodelSpec.full(ModelConfig(arch="resnet18", num_classes=10, in_channels=3, image_size=32))
    weights = {k: v for k, v in build(spec).state_dict().items()}
    result = Result(
        round=0,
        device_id="dev-0",
        task_id="r0-dev-0",
        spec_id=spec.id,
        weights=weights,
        num_samples=500,
        metrics={"loss_mean": 1.0},
    )
    return encode_result(result, "bench")


class Receiver:
    """A subscriber that signals when a raw payload, or a chunked transfer's reassembled payload, is complete."""

    def __init__(self, port: int, topic: str) -> None:
        self.done = threading.Event()
        self.received: bytes | None = None
        self.inbound = Inbound(128 * 1024 * 1024)
        self.client = make_client(f"receiver-{time.monotonic_ns()}")
        self.client.on_message = self._on_message
        connect_and_wait(self.client, "127.0.0.1", port)
        self.client.subscribe(topic, qos=QOS)
        time.sleep(0.3)

    def _on_message(self, _c: object, _u: object, message: object) -> None:
        payload = message.payload  # type: ignore[attr-defined]
        if payload[:4] == b"NSTL" and read_header(payload)["kind"] == CHUNK_KIND:
            payload = self.inbound.add(payload)
            if payload is None:
                return
        self.received = payload
        self.done.set()


def time_transfer(sender, receiver: Receiver, topic: str, payload: bytes, chunked: bool) -> float:
    receiver.done.clear()
    started = time.perf_counter()
    frames = Outbound(256 * 1024).frames(payload, "receiver") if chunked else [payload]
    for frame in frames:
        sender.publish(topic, frame, qos=QOS)
    if not receiver.done.wait(300):
        raise RuntimeError("transfer did not complete within 300 s")
    seconds = time.perf_counter() - started
    assert receiver.received is not None and len(receiver.received) == len(payload)
    return seconds


def chunked_over_raw(port: int, repeats: int) -> float:
    payload = resnet18_result()
    topic = FleetTopics(FLEET).result("dev-0")
    receiver = Receiver(port, topic)
    sender = make_client("sender")
    sender.max_inflight_messages_set(64)  # as the agent sets it
    connect_and_wait(sender, "127.0.0.1", port)
    raw, chunked = [], []
    for _ in range(repeats):  # interleaved, so load changes on the shared machine hit both alike
        raw.append(time_transfer(sender, receiver, topic, payload, chunked=False))
        chunked.append(time_transfer(sender, receiver, topic, payload, chunked=True))
    raw_s, chunked_s = statistics.median(raw), statistics.median(chunked)
    print(
        f"result of {len(payload) / 1e6:.1f} MB: raw publish {raw_s:.3f} s, chunked {chunked_s:.3f} s "
        f"(median of {repeats}; raw {', '.join(f'{t:.2f}' for t in raw)}; "
        f"chunked {', '.join(f'{t:.2f}' for t in chunked)})",
        flush=True,
    )
    sender.disconnect()
    receiver.client.disconnect()
    return chunked_s / raw_s


# -- 50 echo agents (run in their own process) ------------------------------------------------------
def echo_agents(port: int, count: int) -> None:
    """Agents that answer each task at once with its own weights: the coordination path without training.

    They speak the protocol like edge/agent.py: retained status on connect, hello again when the server asks or
    announces a session (a server ignores retained frames it finds on connecting)."""
    topics = FleetTopics(FLEET)
    clients = []
    for index in range(count):
        device_id = f"echo-{index:03d}"
        client = make_client(f"{FLEET}-{device_id}", will=(topics.status(device_id), OFFLINE, True))
        client.max_inflight_messages_set(64)
        inbound = Inbound(64 * 1024 * 1024)
        hello = encode_hello(device_id, {"num_samples": 10, "index": index})

        def on_message(cl, _u, message, device_id=device_id, inbound=inbound, hello=hello) -> None:
            payload = message.payload
            if message.topic == topics.server_status:
                if payload and payload != OFFLINE:  # a server (re)started: say hello to its session
                    cl.publish(topics.hello(device_id), hello, qos=QOS)
                return
            kind = read_header(payload)["kind"]
            if message.topic == topics.ctrl(device_id):
                if kind == REHELLO:
                    cl.publish(topics.hello(device_id), hello, qos=QOS)
                return
            if kind == CHUNK_KIND:
                payload = inbound.add(payload)
                if payload is None:
                    return
            task, session = decode_task(decode_message(payload))
            result = Result(
                task.round, device_id, task.task_id, task.spec_id, task.weights, 10, {"loss_mean": 0.0}
            )
            for frame in Outbound(256 * 1024).frames(encode_result(result, session), "server"):
                cl.publish(topics.result(device_id), frame, qos=QOS)

        client.on_message = on_message
        connect_and_wait(client, "127.0.0.1", port)
        client.subscribe(
            [(topics.task(device_id), QOS), (topics.ctrl(device_id), QOS), (topics.server_status, QOS)]
        )
        client.publish(topics.hello(device_id), hello, qos=QOS)
        status = encode_status(DeviceStatus(device_id, "online", None, {}))
        client.publish(topics.status(device_id), status, qos=QOS, retain=True)
        clients.append(client)
    print("agents ready", flush=True)
    sys.stdin.readline()  # until the benchmark closes our stdin


def round_overhead(port: int, agents: int, rounds: int) -> float:
    child = subprocess.Popen(
        [sys.executable, __file__, "--echo-agents", str(agents), "--port", str(port)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "agents ready"
        ctx = StrategyContext(
            arch="tinycnn",
            num_classes=10,
            in_channels=1,
            image_size=16,
            num_clients=agents,
            total_rounds=rounds,
        )
        strategy = create_strategy("fedavg", ctx)
        topics = FleetTopics(FLEET)
        client = make_client(f"{FLEET}-server", will=(topics.server_status, OFFLINE, True))
        transport = MqttTransport(
            client,
            topics,
            DeviceRegistry(),
            WallClock(),
            TransportSettings(round_min_devices=agents, device_wait_s=60),
        )
        transport.connect("127.0.0.1", port)
        transport.wait_for_devices(agents, 60)
        policy = RoundPolicy(rounds=rounds, fraction=1.0, quorum=1.0, deadline_s=60.0, eval_every=0)
        with tempfile.TemporaryDirectory() as out:
            records = Coordinator(strategy, transport, WallClock(), None, policy, Path(out)).run()
        transport.close()
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(30)
    assert all(r.accepted == agents for r in records), [r.accepted for r in records]
    walls = [r.wall_seconds for r in records]
    print(
        f"{agents} echo agents, {rounds} rounds (tinycnn, fedavg, checkpoint each round): per-round wall "
        f"{', '.join(f'{w:.3f}' for w in walls)} s; median {statistics.median(walls):.3f} s",
        flush=True,
    )
    return statistics.median(walls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--echo-agents", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.echo_agents:
        echo_agents(args.port, args.echo_agents)
        return 0
    if mosquitto_binary() is None:
        print("mosquitto is not installed (apt-get install mosquitto)", file=sys.stderr)
        return 2
    port = find_free_port()
    broker = start_mosquitto(None, port)
    try:
        ratio = chunked_over_raw(port, args.repeats)
        overhead = round_overhead(port, args.agents, args.rounds)
    finally:
        broker.terminate()
        broker.wait(10)
    print(f"chunked_over_raw={ratio:.2f} round_overhead_s={overhead:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
