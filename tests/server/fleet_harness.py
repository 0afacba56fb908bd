"""Test helpers for fleet tests: a scriptable fake device, config writers, and agent/server processes."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
import torch

from nestling.messages import Result, Task
from nestling.wire.chunking import decode_chunk_request, split_into_chunks
from nestling.wire.client import connect_and_wait, make_client
from nestling.wire.codec import CHUNK_KIND, decode_message, read_header
from nestling.wire.fleet_messages import decode_server_status, decode_task, encode_hello, encode_result
from nestling.wire.topics import OFFLINE, QOS, FleetTopics
from nestling.wire.transfers import Inbound

REPO = Path(__file__).resolve().parents[2]
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def wait_until(condition: Callable[[], object], timeout: float, what: str, every: float = 0.05) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


class FakeDevice:
    """A device driven step by step by a test: says hello, receives tasks, sends (possibly broken) results."""

    def __init__(self, host: str, port: int, fleet: str, device_id: str) -> None:
        self.device_id = device_id
        self.topics = FleetTopics(fleet)
        self.inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.inbound = Inbound(256 * 1024 * 1024)
        self.sent_chunks: list[bytes] = []
        self.client = make_client(
            f"fake-{fleet}-{device_id}", will=(self.topics.status(device_id), OFFLINE, True)
        )
        self.client.on_message = lambda _c, _u, m: self.inbox.put((m.topic, m.payload))
        connect_and_wait(self.client, host, port)
        self.client.subscribe([(self.topics.task(device_id), QOS), (self.topics.ctrl(device_id), QOS)])
        time.sleep(0.1)

    def hello(self, **profile: object) -> None:
        body = {"num_samples": 100, "index": 0, **profile}
        self.publish("hello", encode_hello(self.device_id, body))

    def publish(self, channel: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(
            self.topics.device(self.device_id, channel), payload, qos=QOS, retain=retain
        ).wait_for_publish(5)

    def next_task(self, timeout: float = 10.0) -> tuple[Task, str]:
        give_up = time.monotonic() + timeout
        while True:
            topic, payload = self.inbox.get(timeout=max(0.01, give_up - time.monotonic()))
            if topic != self.topics.task(self.device_id):
                continue
            if read_header(payload)["kind"] == CHUNK_KIND:
                payload = self.inbound.add(payload)
                if payload is None:
                    continue
            return decode_task(decode_message(payload))

    def next_ctrl(self, timeout: float = 10.0) -> bytes:
        give_up = time.monotonic() + timeout
        while True:
            topic, payload = self.inbox.get(timeout=max(0.01, give_up - time.monotonic()))
            if topic == self.topics.ctrl(self.device_id):
                return payload

    def send_result(
        self, result: Result, session: str, *, chunk_size: int | None = None, skip: tuple[int, ...] = ()
    ) -> None:
        """Publish a result, chunked when `chunk_size` is given, leaving out chunk indices in `skip`."""
        payload = encode_result(result, session)
        if chunk_size is None:
            self.publish("result", payload)
            return
        self.sent_chunks = split_into_chunks(f"{self.device_id}-{time.monotonic_ns()}", payload, chunk_size)
        for index, chunk in enumerate(self.sent_chunks):
            if index not in skip:
                self.publish("result", chunk)

    def answer_rerequest(self, timeout: float = 10.0) -> tuple[int, ...]:
        request = decode_chunk_request(self.next_ctrl(timeout))
        for index in request.indices:
            self.publish("result", self.sent_chunks[index])
        return request.indices

    def close(self, abrupt: bool = False) -> None:
        if abrupt:  # like a board losing power: no DISCONNECT, the broker publishes the last will
            self.client.socket().close()
            time.sleep(0.2)
        else:
            self.client.disconnect()
        self.client.loop_stop()


def echo_result(task: Task, **changes: object) -> Result:
    """The result a device would send without training: the task's own tensors back."""
    result = Result(
        round=task.round,
        device_id=task.device_id,
        task_id=task.task_id,
        spec_id=task.spec_id,
        weights={k: v.clone() for k, v in task.weights.items()},
        num_samples=10,
        metrics={"loss_mean": 1.0, "train_seconds": 0.01},
    )
    for key, value in changes.items():
        setattr(result, key, value)
    return result


def fleet_toml(
    url: str,
    fleet: str,
    *,
    devices: int,
    rounds: int = 3,
    out_dir: str = "out",
    credentials: str = "",
    arch: str = "tinycnn",
    method: str = "nefl-wd",
    deadline_s: float = 30.0,
    quorum: float = 0.6,
    local_steps: int = 2,
    method_options: str = "flex = 0",
    extra_fleet: str = "",
    extra_run: str = "",
    enrolment: str = "open = true",
) -> str:
    """A fleet.toml; `enrolment` is its [enrolment] table's body (open unless a test lists the devices)."""
    return textwrap.dedent(f"""\
        [broker]
        url = "{url}"
        fleet = "{fleet}"
        credentials = "{credentials}"
        [fleet]
        devices = {devices}
        heartbeat_timeout_s = 15
        registration_timeout_s = 300  # five agent processes on a busy 2-core box took over 120 s
        {extra_fleet}
        [enrolment]
        {enrolment}
        [run]
        rounds = {rounds}
        deadline_s = {deadline_s}
        quorum = {quorum}
        out_dir = "{out_dir}"
        {extra_run}
        [data]
        dataset = "digits"
        [model]
        arch = "{arch}"
        [method]
        name = "{method}"
        {method_options}
        [train]
        fraction = 1.0
        local_steps = {local_steps}
        batch_size = 16
        """)


def agent_toml(
    url: str,
    fleet: str,
    device_id: str,
    *,
    index: int,
    clients: int,
    budget_mb: float = 6.0,
    credentials: str = "",
) -> str:
    return textwrap.dedent(f"""\
        [broker]
        url = "{url}"
        fleet = "{fleet}"
        credentials = "{credentials}"
        [device]
        id = "{device_id}"
        memory_budget_mb = {budget_mb}
        [data]
        dataset = "digits"
        client_index = {index}
        num_clients = {clients}
        [agent]
        heartbeat_s = 1.0
        """)


def spawn(module: str, args: list[str], log: Path) -> subprocess.Popen:
    """A child Python process (one torch thread) writing its output to `log`."""
    handle = log.open("ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            env=CHILD_ENV,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    finally:
        handle.close()


def start_agents(
    tmp: Path,
    url: str,
    fleet: str,
    count: int,
    budgets: list[float] | None = None,
    credentials: dict[str, Path] | None = None,
) -> list[subprocess.Popen]:
    """Agents dev-0 … dev-<count-1>, each with its share of digits (and its broker credentials, if given)."""
    agents = []
    for i in range(count):
        config = tmp / f"agent-{i}.toml"
        budget = budgets[i] if budgets else 6.0
        login = str(credentials[f"dev-{i}"]) if credentials else ""
        config.write_text(
            agent_toml(url, fleet, f"dev-{i}", index=i, clients=count, budget_mb=budget, credentials=login)
        )
        agents.append(spawn("nestling.edge.agent_cli", ["--config", str(config)], tmp / f"agent-{i}.log"))
    return agents


def stop_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def metrics(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


class FleetWatch:
    """Watches a fleet from outside: the server's retained status, and task frames to fire fault injections."""

    def __init__(self, host: str, port: int, fleet: str) -> None:
        self.topics = FleetTopics(fleet)
        self.status: tuple[str, int | None] | None = None
        self._triggers: list[tuple[int, str | None, Callable[[], None], threading.Event]] = []
        self._lock = threading.Lock()
        self.client = make_client(f"watch-{fleet}-{time.monotonic_ns()}")
        self.client.on_message = self._on_message
        connect_and_wait(self.client, host, port)
        self.client.subscribe([(self.topics.server_status, QOS), (self.topics.all_devices("task"), QOS)])

    def when_task(
        self, round_index: int, action: Callable[[], None], device_id: str | None = None
    ) -> threading.Event:
        """Run `action` as soon as the first task of `round_index` (to `device_id`, or anyone) is published."""
        fired = threading.Event()
        with self._lock:
            self._triggers.append((round_index, device_id, action, fired))
        return fired

    def _on_message(self, _client: object, _userdata: object, message: mqtt.MQTTMessage) -> None:
        if message.topic == self.topics.server_status:
            if bytes(message.payload) != OFFLINE:
                status = decode_server_status(message.payload)
                self.status = (status.phase, status.round)
            return
        header = read_header(message.payload)
        with self._lock:
            for round_index, device_id, action, fired in self._triggers:
                to = None if device_id is None else self.topics.task(device_id)
                if not fired.is_set() and header.get("round") == round_index and to in (None, message.topic):
                    action()
                    fired.set()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def state_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}
