"""Property: any JSON value in any field of any message a board sends, through the real decode path and the real
coordinator with every registered method, ends in a named refusal or a correct round, never a crash (issue 25).

The server side is the real MqttTransport (paho's network thread replaced by handing it each frame as paho's
callback would) and the real Coordinator. Three boards answer every task; board-2 sends one hostile frame: its
hello, a heartbeat, its result or one chunk of it, with one field replaced by a generated JSON value (nested
objects, huge integers, ±1e999, strings, lists). It then sends its honest result, as a board that retries would.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import struct
from functools import cache
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nestling.messages import Task
from nestling.profiler.board_profile import emulated_board_profile
from nestling.server.clock import WallClock
from nestling.server.coordinator import Coordinator, RoundPolicy
from nestling.server.mqtt_transport import MqttTransport, TransportSettings
from nestling.server.registry import DeviceRegistry
from nestling.server.strategies import STRATEGIES, Strategy, StrategyContext, create_strategy
from nestling.spec import SubmodelSpec
from nestling.wire.chunking import split_into_chunks
from nestling.wire.client import make_client
from nestling.wire.codec import FORMAT_VERSION, MAGIC, unpack_frame
from nestling.wire.fleet_messages import DeviceStatus, encode_hello, encode_result, encode_status
from nestling.wire.topics import FleetTopics
from tests.server.fleet_harness import echo_result

FLEET = "props"
BOARDS = ("board-0", "board-1", "board-2")
HOSTILE = "board-2"
METHODS = sorted(STRATEGIES)
_INF = "\x00inf\x00"  # stands for 1e999 in a generated value: JSON text can carry it, Python's encoder cannot

# Every field of every inbound message, as a path into its frame header (meta holds the body's fields).
FIELDS: dict[str, list[tuple[str, ...]]] = {
    "hello": [
        *[
            ("meta", name)
            for name in (
                "num_samples",
                "index",
                "tier",
                "labels",
                "memory_budget_bytes",
                "budget",
                "profiling",
                "board_profile",
                "export",
                "emulating",
                "dataset",
                "cores",
                "total_memory_bytes",
                "not_a_field",
            )
        ],
        ("meta", "budget", "memory_bytes"),
        ("meta", "budget", "macs"),
        ("meta", "emulating", "gflops"),
        ("meta", "export", "format"),
        *[("meta", "board_profile", name) for name in ("gflops", "step_s", "parts", "batch", "memory_bytes")],
        ("meta",),
        ("device_id",),
        ("round",),
        ("spec_id",),
        ("message_id",),
        ("extra_header",),
    ],
    "status": [
        ("meta", "state"),
        ("meta", "resources"),
        ("meta", "resources", "cpu_percent"),
        ("meta", "resources", "rss_bytes"),
        ("meta", "resources", "temperature_c"),
        ("meta", "not_a_field"),
        ("round",),
        ("device_id",),
    ],
    "result": [
        *[
            ("meta", name)
            for name in ("task_id", "session", "num_samples", "metrics", "model_id", "not_a_field")
        ],
        *[
            ("meta", "metrics", name)
            for name in (
                "train_seconds",
                "train_wall_s",
                "loss_mean",
                "steps",
                "peak_memory_bytes",
                "untouched",
                "dynamicfl_structure",
                "dynamicfl_expanded",
                "a_plugin_metric",
                "Not A Name",
            )
        ],
        ("round",),
        ("spec_id",),
        ("device_id",),
        ("schema",),
    ],
    "chunk": [
        (name,)
        for name in (
            "transfer_id",
            "index",
            "count",
            "chunk_size",
            "total_length",
            "payload_sha256",
            "not_a_field",
        )
    ],
}
KINDS = sorted(FIELDS)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([0, -1, 10**400, -(10**400), 2**63, 10**9 + 1, _INF, "-" + _INF])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=24),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


def _context(method: str) -> StrategyContext:
    if method in ("fedepth", "m-fedepth", "scalefl"):  # need more blocks and memory than the tiny CNN has
        return StrategyContext(
            arch="resnet20",
            num_classes=4,
            in_channels=3,
            image_size=32,
            num_clients=3,
            total_rounds=100,
            seed=0,
        )
    return StrategyContext(
        arch="tinycnn", num_classes=10, in_channels=1, image_size=16, num_clients=3, total_rounds=100, seed=0
    )


@cache
def _pristine(method: str) -> Strategy:
    return create_strategy(method, _context(method))


def _set(header: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = header
    for name in path[:-1]:
        if not isinstance(node.get(name), dict):
            node[name] = {}
        node = node[name]
    node[path[-1]] = value


def _json(value: Any) -> str:
    text = json.dumps(value, separators=(",", ":"))
    return text.replace(json.dumps("-" + _INF), "-1e999").replace(json.dumps(_INF), "1e999")


def reframed(frame: bytes, path: tuple[str, ...], value: Any) -> bytes:
    """`frame` with one header field replaced by `value`, packed by hand (the codec would refuse to write it)."""
    original = unpack_frame(frame)
    header = copy.deepcopy(original.header)
    _set(header, path, value)
    text = _json(header).encode()
    return b"".join((struct.pack(">4sBI", MAGIC, FORMAT_VERSION, len(text)), text, bytes(original.body)))


class Boards:
    """The three boards' side: hellos now, and an answer to each task as soon as it is dispatched."""

    def __init__(
        self, transport: MqttTransport, strategy: Strategy, kind: str, path: tuple[str, ...], value: Any
    ):
        self.transport, self.kind, self.path, self.value = transport, kind, path, value
        self.topics = FleetTopics(FLEET)
        full = SubmodelSpec.full(strategy.make_model_config())
        self.board_profile = emulated_board_profile(full, 32, 10.0, 2**30, "props").to_dict()

    def deliver(self, topic: str, payload: bytes) -> None:
        """What paho's network thread does with a message from the broker."""
        message = mqtt.MQTTMessage(topic=topic.encode())
        message.payload = payload
        self.transport.link.client.on_message(self.transport.link.client, None, message)

    def say_hello(self) -> None:
        for index, board in enumerate(BOARDS):
            profile: dict[str, Any] = {"num_samples": 20, "index": index}
            if board == HOSTILE:
                profile["board_profile"] = self.board_profile
            frame = encode_hello(board, profile)
            if board == HOSTILE and self.kind == "hello":
                frame = reframed(frame, self.path, self.value)
            self.deliver(self.topics.hello(board), frame)
        if self.kind == "status":
            frame = encode_status(DeviceStatus(HOSTILE, "online", None, {"cpu_percent": 5.0}))
            self.deliver(self.topics.status(HOSTILE), reframed(frame, self.path, self.value))

    def answer(self, tasks: list[Task]) -> None:
        for task in tasks:
            honest = encode_result(echo_result(task), self.transport.session)
            topic = self.topics.result(task.device_id)
            if task.device_id == HOSTILE and self.kind == "result":
                self.deliver(topic, reframed(honest, self.path, self.value))
            elif task.device_id == HOSTILE and self.kind == "chunk":
                chunks = split_into_chunks(f"t-{task.task_id}", honest, 1024)
                chunks[0] = reframed(chunks[0], self.path, self.value)
                for chunk in chunks:
                    self.deliver(topic, chunk)
            self.deliver(topic, honest)  # a board that retries: its honest result follows


def _strict_json(line: str) -> dict[str, Any]:
    def refuse(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=refuse)


def play(method: str, kind: str, path: tuple[str, ...], value: Any, out_dir: Path) -> dict[str, int]:
    """One round with board-2's hostile frame; checks the property and returns the transport's refusals."""
    strategy = copy.deepcopy(_pristine(method))
    topics = FleetTopics(FLEET)
    transport = MqttTransport(
        make_client(f"{FLEET}-server"),  # never connected: frames are handed to it below
        topics,
        DeviceRegistry(),
        WallClock(),
        TransportSettings(device_wait_s=0.0, round_min_devices=1, rehello_every_s=3600.0),
    )
    boards = Boards(transport, strategy, kind, path, value)
    boards.say_hello()
    dispatch = transport.dispatch

    def dispatch_and_answer(tasks: list[Task]) -> None:
        dispatch(tasks)
        boards.answer(tasks)

    transport.dispatch = dispatch_and_answer  # type: ignore[method-assign]
    policy = RoundPolicy(rounds=1, fraction=1.0, quorum=0.5, deadline_s=20.0, seed=0)
    record = Coordinator(strategy, transport, WallClock(), None, policy, out_dir=out_dir).run_round(0)

    refusals = {k: v for k, v in transport.counters.items() if k.startswith("rejected_") and v}
    assert "rejected_internal_error" not in refusals, refusals
    assert "rejected_error" not in record.counters and "rejected_assign" not in record.counters
    # the honest boards' round went through: board-0 and board-1 always, board-2 once it was admitted
    assert record.aggregated and record.accepted >= 2, (record.counters, refusals)
    assert all(bool(torch.isfinite(t).all()) for t in strategy.global_state.values() if t.is_floating_point())
    for device in transport.registry.available():  # whatever was admitted has the schema's types
        info = device
        assert isinstance(info.num_samples, int) and not isinstance(info.num_samples, bool)
        assert 0 <= info.index <= 10**6
        tier = (info.profile or {}).get("tier")
        assert tier is None or (isinstance(tier, int) and 0 <= tier <= 1023)
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    line = _strict_json(lines[-1])
    assert line["train_loss"] is None or math.isfinite(line["train_loss"])
    return refusals


def _any_value_in_any_field(method: str, tmp_path: Path, profile: settings) -> None:
    """Hypothesis draws a message kind, one of its fields and a JSON value, and plays it through the server."""

    @profile
    @given(
        st.sampled_from(KINDS).flatmap(lambda k: st.tuples(st.just(k), st.sampled_from(FIELDS[k]))),
        json_values,
    )
    def check(kind_and_path: tuple[str, tuple[str, ...]], value: Any) -> None:
        kind, path = kind_and_path
        out = tmp_path / hashlib.sha256(repr((kind, path, value)).encode()).hexdigest()[:16]
        play(method, kind, path, value, out)

    check()


@pytest.mark.parametrize("method", METHODS)
def test_any_value_in_any_inbound_field_is_refused_by_name_or_harmless(method: str, tmp_path: Path) -> None:
    _any_value_in_any_field(
        method,
        tmp_path,
        settings(
            max_examples=6,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_deeper_any_value_in_any_inbound_field(method: str, tmp_path: Path) -> None:
    """The same property, many more examples per method (a nightly-sized profile)."""
    _any_value_in_any_field(
        method, tmp_path, settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    )


@pytest.mark.parametrize(
    ("kind", "path", "value", "counter"),
    [  # the attacks issue 25 names, each refused by name
        ("hello", ("meta", "tier"), "abc", "rejected_bad_hello"),
        ("hello", ("meta", "tier"), [1], "rejected_bad_hello"),
        ("hello", ("meta", "tier"), -100, "rejected_bad_hello"),
        ("hello", ("meta", "tier"), _INF, "rejected_bad_hello"),
        ("hello", ("meta", "budget"), "lots", "rejected_bad_hello"),
        ("hello", ("meta", "budget", "memory_bytes"), _INF, "rejected_bad_hello"),
        ("hello", ("meta", "board_profile", "gflops"), 1e6, "rejected_bad_profile"),
        ("result", ("meta", "metrics", "train_seconds"), "fast", "rejected_bad_result"),
        ("result", ("meta", "metrics", "loss_mean"), "low", "rejected_bad_result"),
        ("result", ("meta", "metrics", "loss_mean"), _INF, "rejected_bad_result"),
        ("chunk", ("count",), 10**400, "rejected_bad_chunk"),
    ],
)
def test_the_named_attacks_are_refused_by_name(
    kind: str, path: tuple[str, ...], value: Any, counter: str, tmp_path: Path
) -> None:
    for method in ("nefl-wd", "dynamicfl"):  # refused at the door: the method never sees them
        refusals = play(method, kind, path, value, tmp_path / method)
        assert refusals.get(counter, 0) >= 1, (method, refusals)
