"""Measure the fleet transport's time inside a round for `[run] transport_time` (simulator/transport_time.py).

A standalone measurement, not fitted to any fleet run: the real server transport (MqttTransport, the wire codec,
chunking) publishes rounds of tasks through the embedded broker (`nestling broker`, as `fidelity.py` runs its
fleet) to echo boards in another process. Each board notes when its task's first chunk arrived (the moment an
emulating agent starts pacing its download), holds the task so no upload crosses a later download, and sends the
same tensors back, noting when it published. The server notes when it holds each result decoded. All on this
host's monotonic clock, which both processes share.

Per round of K tasks dispatched at t0: task k's first chunk arrives at `reach_k - t0 ~ hop + (k + 1) x c(MB)`
(the server encodes and publishes one task after another), so the slope over k is the per-task cost c and the
intercept the broker hop down. Two models of different size split c into a fixed part and a part per MB, and
split a result's way back (`received - sent`) into the hop up and the collection per MB.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks._fidelity_transport
Ends with the [run] keys as one line of key=value figures.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FLEET = "transport-time"
REPO = Path(__file__).resolve().parents[1]
MODELS = ("resnet20", "tinycnn")  # the fidelity benchmark's model, and a small one to split the cost per MB
INPUT_SHAPE = (1, 16, 16)  # digits, as the fidelity benchmark trains them


def echo_boards(port: int, count: int, hold_s: float) -> None:
    """Boards that note their task's first chunk, hold it `hold_s`, then send its tensors back (their own
    process: a fleet's boards never share the server's interpreter)."""
    from nestling.messages import Result
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

    topics = FleetTopics(FLEET)
    clients = []
    for index in range(count):
        device_id = f"echo-{index:02d}"
        client = make_client(f"{FLEET}-{device_id}", will=(topics.status(device_id), OFFLINE, True))
        inbound = Inbound(64 * 1024 * 1024)
        hello = encode_hello(device_id, {"num_samples": 10, "index": index})
        first_seen: dict[str, float] = {}

        def answer(cl: Any, payload: bytes, seen: float, device_id: str = device_id) -> None:
            task, session = decode_task(decode_message(payload))
            time.sleep(max(0.0, seen + hold_s - time.monotonic()))
            sent = time.monotonic()
            metrics = {"first_seen": seen, "sent_at": sent}
            result = Result(task.round, device_id, task.task_id, task.spec_id, task.weights, 10, metrics)
            for frame in Outbound(256 * 1024).frames(encode_result(result, session), "server"):
                cl.publish(topics.result(device_id), frame, qos=QOS)

        def on_message(
            cl: Any,
            _u: Any,
            message: Any,
            device_id: str = device_id,
            inbound: Any = inbound,
            hello: bytes = hello,
            first_seen: dict[str, float] = first_seen,
            answer: Any = answer,
        ) -> None:
            now = time.monotonic()
            payload = message.payload
            if message.topic == topics.server_status:
                # The server's first announcement: say hello to it (later ones report its phase; the server
                # asks on ctrl if it needs another hello).
                if payload and payload != OFFLINE and not first_seen.get("greeted"):
                    first_seen["greeted"] = now
                    cl.publish(topics.hello(device_id), hello, qos=QOS)
                return
            kind = read_header(payload)["kind"]
            if message.topic == topics.ctrl(device_id):
                if kind == REHELLO:
                    cl.publish(topics.hello(device_id), hello, qos=QOS)
                return
            first_seen.setdefault("task", now)
            if kind == CHUNK_KIND:
                payload = inbound.add(payload)
                if payload is None:
                    return
            seen = first_seen.pop("task")
            threading.Thread(target=answer, args=(cl, payload, seen), daemon=True).start()

        client.on_message = on_message
        connect_and_wait(client, "127.0.0.1", port)
        client.subscribe(
            [(topics.task(device_id), QOS), (topics.ctrl(device_id), QOS), (topics.server_status, QOS)]
        )
        client.publish(topics.hello(device_id), hello, qos=QOS)
        status = encode_status(DeviceStatus(device_id, "online", None, {}))
        client.publish(topics.status(device_id), status, qos=QOS, retain=True)
        clients.append(client)
    print("boards ready", flush=True)
    sys.stdin.readline()  # until the measurement closes our stdin


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def derive(samples: Sequence[dict[str, float]]) -> dict[str, float]:
    """The four [run] figures from per-task samples (mb, order k from 0, reach_s, back_s): per model size the
    slope of reach over k+1 is the serial cost per task, its intercept the hop down; two sizes split the
    serial cost and the way back into a fixed part and a part per MB. Negative parts read 0."""
    sizes = sorted({s["mb"] for s in samples})
    if len(sizes) < 2:
        raise ValueError("the transport measurement needs tasks of two sizes")
    per_size = {}
    for mb in (sizes[0], sizes[-1]):
        rows = [s for s in samples if s["mb"] == mb]
        hop_down, serial = fit_line([s["k"] + 1 for s in rows], [s["reach_s"] for s in rows])
        per_size[mb] = (hop_down, serial, statistics.median(s["back_s"] for s in rows))
    (small, large), span = (sizes[0], sizes[-1]), sizes[-1] - sizes[0]
    per_mb = (per_size[large][1] - per_size[small][1]) / span
    collect_per_mb = (per_size[large][2] - per_size[small][2]) / span
    hop_up = per_size[small][2] - max(0.0, collect_per_mb) * small
    hops = [per_size[small][0], per_size[large][0], hop_up]
    return {
        "transport_dispatch_s": round(max(0.0, per_size[small][1] - max(0.0, per_mb) * small), 6),
        "transport_dispatch_s_per_mb": round(max(0.0, per_mb), 6),
        "transport_hop_s": round(max(0.0, statistics.median(hops)), 6),
        "transport_collect_s_per_mb": round(max(0.0, collect_per_mb), 6),
    }


def tasks_of(model: str, round_index: int, devices: Sequence[str]) -> list[Any]:
    """One round's tasks: the full model's tensors for every board, as fedavg sends them."""
    from nestling.messages import Task
    from nestling.models.config import ModelConfig
    from nestling.models.zoo import build
    from nestling.spec import SubmodelSpec

    channels, size = INPUT_SHAPE[0], INPUT_SHAPE[1]
    spec = SubmodelSpec.full(ModelConfig(arch=model, num_classes=10, in_channels=channels, image_size=size))
    weights = build(spec).state_dict()
    return [
        Task(round_index, d, spec.to_dict(), dict(weights), "sgd", task_id=f"r{round_index}-{d}")
        for d in devices
    ]


def measure(boards: int, rounds: int, hold_s: float) -> list[dict[str, float]]:
    """Per-task samples from `rounds` rounds of each model through a fresh embedded broker."""
    from nestling.profiler.speed import payload_bytes
    from nestling.server.broker import find_free_port, wait_for_port
    from nestling.server.clock import WallClock
    from nestling.server.mqtt_transport import MqttTransport, TransportSettings
    from nestling.server.registry import DeviceRegistry
    from nestling.wire.client import make_client
    from nestling.wire.topics import OFFLINE, FleetTopics

    port = find_free_port()
    procs: list[subprocess.Popen[Any]] = [
        subprocess.Popen(
            [sys.executable, "-m", "nestling.cli", "broker", "--port", str(port)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    samples: list[dict[str, float]] = []
    try:
        if not wait_for_port("127.0.0.1", port, 30.0):
            raise RuntimeError("the embedded broker did not come up")
        argv = [sys.executable, "-m", "benchmarks._fidelity_transport", "--echo", str(boards)]
        argv += ["--port", str(port), "--hold-s", repr(hold_s)]
        echo = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(echo)
        assert echo.stdout is not None and echo.stdout.readline().strip() == "boards ready"
        topics = FleetTopics(FLEET)
        settings = TransportSettings(round_min_devices=boards, device_wait_s=60)
        client = make_client(f"{FLEET}-server", will=(topics.server_status, OFFLINE, True))
        transport = MqttTransport(client, topics, DeviceRegistry(), WallClock(), settings)
        transport.connect("127.0.0.1", port)
        devices = [d.device_id for d in transport.wait_for_devices(boards, 60)]
        round_index = 0
        for model in MODELS:
            for repeat in range(rounds + 1):  # the first round of each model warms up and is dropped
                tasks = tasks_of(model, round_index, devices)
                order = {t.task_id: k for k, t in enumerate(tasks)}
                mb = payload_bytes(tasks[0].weights) / 1e6
                started = time.monotonic()
                transport.dispatch(tasks)
                got = 0
                while got < len(tasks):
                    delivery = transport.wait(time.monotonic() + 30.0, len(tasks) - got)
                    held = time.monotonic()
                    if delivery.rejected:
                        print(f"round {round_index}: refused {delivery.rejected}", file=sys.stderr)
                    if not delivery.results and not delivery.rejected:
                        raise RuntimeError(
                            f"round {round_index}: no result ({delivery}, {dict(transport.counters)})"
                        )
                    for result in delivery.results:
                        got += 1
                        if repeat:
                            samples.append(
                                {
                                    "mb": mb,
                                    "k": order[result.task_id],
                                    "reach_s": result.metrics["first_seen"] - started,
                                    "back_s": held - result.metrics["sent_at"],
                                }
                            )
                transport.cancel(round_index)
                round_index += 1
        transport.close()
    finally:
        for proc in reversed(procs):
            if proc.stdin is not None:
                proc.stdin.close()
            proc.terminate()
            proc.wait(15)
    return samples


def measure_transport_time(boards: int = 4, rounds: int = 5, hold_s: float = 1.0) -> dict[str, Any]:
    """The [run] transport_time keys measured on this host, with the samples they came from."""
    samples = measure(boards, rounds, hold_s)
    return {"transport_time": "fixed", **derive(samples), "samples": samples}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boards", type=int, default=4, help="echo boards (tasks a round)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per model")
    parser.add_argument("--hold-s", type=float, default=1.0, help="seconds a board holds its task")
    parser.add_argument("--out", type=Path, help="write the keys and samples to this JSON file")
    parser.add_argument("--echo", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.echo:
        echo_boards(a.port, a.echo, a.hold_s)
        return 0
    measured = measure_transport_time(a.boards, a.rounds, a.hold_s)
    if a.out is not None:
        from nestling.strict_json import write_strict_json

        write_strict_json(a.out, measured, indent=1)
    keys = {k: v for k, v in measured.items() if k != "samples"}
    print(" ".join(f"{k}={v}" for k, v in keys.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
