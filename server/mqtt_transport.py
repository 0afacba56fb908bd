"""MqttTransport: the coordinator's Transport over an MQTT broker (registration, tasks, results, dropouts).

paho's network thread only queues incoming messages; everything else (decoding, checks, registry,
re-requests) runs on the coordinator's thread inside `devices()` / `wait()`, so the transport's
state needs no locks and a hostile message can at worst be counted, never crash the round loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt

from nestling.errors import ConfigError, NestlingError, WireError
from nestling.messages import Result, Task
from nestling.server.clock import Clock
from nestling.server.deployables import ExportLedger
from nestling.server.fleet_admission import (
    Dispatched,
    RecentKeys,
    check_result,
    unsolicited_reason,
    wire_reason,
)
from nestling.server.registry import DeviceRegistry
from nestling.server.strategies.base import DeviceInfo
from nestling.server.transport import Delivery
from nestling.wire.chunking import DEFAULT_CHUNK_SIZE
from nestling.wire.client import connect_and_wait
from nestling.wire.codec import (
    CHUNK_KIND,
    CHUNK_REQUEST_KIND,
    DEFAULT_MAX_MESSAGE_BYTES,
    decode_message,
    read_header,
)
from nestling.wire.export_messages import (
    EXPORT_REPORT,
    ExportOrder,
    ExportReport,
    decode_export_report,
    encode_export_order,
)
from nestling.wire.fleet_messages import (
    RESULT,
    ServerStatus,
    decode_hello,
    decode_result,
    decode_status,
    encode_rehello,
    encode_server_status,
    encode_task,
)
from nestling.wire.topics import HELLO, OFFLINE, QOS, STATUS, FleetTopics, parse_topic
from nestling.wire.topics import RESULT as RESULT_CHANNEL
from nestling.wire.transfers import Inbound, Outbound

log = logging.getLogger("nestling.mqtt")

RESULT_SLACK_BYTES = 1024 * 1024  # a result may exceed its task's encoded size by its header, no more


@dataclass
class TransportSettings:
    """Limits and timings of the fleet transport (the fleet config's [fleet] table fills these)."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    stall_s: float = 1.0  # re-request a transfer's missing chunks after this long without one
    chunk_answer_every_s: float = 0.5  # answer one device's chunk re-requests at most this often
    max_rerequests: int = 5
    transfer_ttl_s: float = 60.0
    round_min_devices: int = 1  # devices() waits for this many available devices ...
    device_wait_s: float = 60.0  # ... at most this long
    rehello_every_s: float = 5.0
    max_inflight: int = 256


class MqttTransport:
    """Implements server.transport.Transport for a fleet; `client` comes from nestling.wire.client.make_client
    with the server's last will on `topics.server_status`."""

    def __init__(
        self,
        client: mqtt.Client,
        topics: FleetTopics,
        registry: DeviceRegistry,
        clock: Clock,
        settings: TransportSettings | None = None,
    ) -> None:
        self.client = client
        self.topics = topics
        self.registry = registry
        self.clock = clock
        self.settings = settings or TransportSettings()
        self.session = uuid.uuid4().hex[:16]
        self.counters: Counter[str] = Counter()
        self.trained_by: dict[str, set[str]] = {}  # spec id → devices whose results of it were accepted
        self.current_round: int | None = None
        self.phase = "waiting"
        self.plan: dict[str, Any] | None = None  # what boards profile (ServerStatus.plan), set by the fleet
        # topic, payload, arrival, retained flag
        self._inbox: queue.SimpleQueue[tuple[str, bytes, float, bool]] = queue.SimpleQueue()
        self._tasks: dict[str, Dispatched] = {}
        self._open: dict[str, str] = {}  # device id → task id it holds in the current round
        self._inbound: dict[str, Inbound] = {}
        self._outbound = Outbound(self.settings.chunk_size)
        self._ready: list[Result] = []
        self._dropped: list[str] = []
        self._rejected: list[tuple[str, str]] = []
        self._counted = RecentKeys()
        self._rehello_at: dict[str, float] = {}
        self._held: dict[str, Result] = {}  # task id -> a later result, kept until the first is judged
        # topics whose retained frame we cleared (their empty echo is ignored)
        self._cleared: set[str] = set()
        # device -> when its last chunk re-request was answered
        self._chunk_answered_at: dict[str, float] = {}
        self._next_tick = 0.0
        self._status_sent: mqtt.MQTTMessageInfo | None = None
        self._subscribed = threading.Event()
        self._connections = 0
        self._reconnected = threading.Event()
        self.exports = ExportLedger()  # end-of-run export orders and the boards' reports
        self._export_frames: dict[str, list[bytes]] = {}  # device id → its order's frames, until it reports
        client.max_inflight_messages_set(self.settings.max_inflight)  # chunks stream without waiting per ack
        client.on_connect = self._on_connect
        client.on_subscribe = lambda *_: self._subscribed.set()
        client.on_message = lambda _c, _u, msg: self._inbox.put(
            (msg.topic, bytes(msg.payload), clock.now(), bool(msg.retain))
        )

    # -- connection (paho's thread) --------------------------------------------------------------
    def _on_connect(
        self, client: mqtt.Client, userdata: object, flags: object, reason: object, properties: object
    ) -> None:
        if getattr(reason, "is_failure", False):
            log.warning("broker refused the server: %s", reason)
            return
        client.subscribe([(self.topics.all_devices(c), QOS) for c in (HELLO, STATUS, RESULT_CHANNEL)])
        self._publish_status()  # re-announce after every (re)connect: the broker may have lost it
        self._connections += 1
        if self._connections > 1:
            self._reconnected.set()  # tasks sent while we were away may be lost: resend the open ones
        log.info("server connected to the broker (session %s)", self.session)

    def connect(self, host: str, port: int, timeout_s: float = 30.0) -> None:
        """Connect and return once the fleet's topics are subscribed (ConfigError if the broker refuses)."""
        connect_and_wait(self.client, host, port, timeout_s=timeout_s)
        if not self._subscribed.wait(timeout_s):
            raise ConfigError(f"MQTT broker {host}:{port} did not confirm the server's subscriptions")

    def publish_status(self, phase: str, round_index: int | None = None) -> None:
        """Retained server/status: what the server is doing (agents also learn its session from it)."""
        self.phase = phase
        if round_index is not None:
            self.current_round = round_index
        self._publish_status()

    def _publish_status(self) -> None:
        payload = encode_server_status(ServerStatus(self.session, self.phase, self.current_round, self.plan))
        self._status_sent = self.client.publish(self.topics.server_status, payload, qos=QOS, retain=True)

    def close(self) -> None:
        """Leave cleanly: the last status stays retained (no last will), then the network thread ends."""
        if self._status_sent is not None and self.client.is_connected():
            self._status_sent.wait_for_publish(2.0)
        self.client.disconnect()
        self.client.loop_stop()

    # -- Transport -------------------------------------------------------------------------------
    def devices(self) -> list[DeviceInfo]:
        return self.wait_for_devices(self.settings.round_min_devices, self.settings.device_wait_s)

    def wait_for_devices(self, count: int, timeout_s: float) -> list[DeviceInfo]:
        """Available devices once at least `count` are (or `timeout_s` passed): handles hellos meanwhile."""
        self._pump(0.0)
        give_up = time.monotonic() + timeout_s
        while len(self.registry.available()) < count and time.monotonic() < give_up:
            self._pump(min(0.2, max(0.0, give_up - time.monotonic())))
        return sorted(self.registry.available(), key=lambda d: d.device_id)

    def dispatch(self, tasks: list[Task]) -> None:
        if tasks:
            # Announce the round before its tasks: an agent resends a result when it sees its round announced
            # (a re-announcement after an outage), so an announcement arriving after a fast answer would
            # trigger a needless duplicate upload.
            self.publish_status("training", tasks[0].round)
        for task in tasks:
            self.current_round = task.round
            payload = encode_task(task, self.session)
            entry = Dispatched.of(task, len(payload) + RESULT_SLACK_BYTES)
            entry.frames = self._outbound.frames(payload, task.device_id)
            self._tasks[task.task_id] = entry
            self._open[task.device_id] = task.task_id
            self._inbound[task.device_id] = Inbound(
                min(entry.limit, self.settings.max_message_bytes),
                stall_s=self.settings.stall_s,
                max_attempts=self.settings.max_rerequests,
                ttl_s=self.settings.transfer_ttl_s,
            )
            self._send_task(entry)
        self._forget_before(self.current_round)
        self.counters["dispatched"] += len(tasks)

    def _send_task(self, entry: Dispatched) -> None:
        for frame in entry.frames:
            self.client.publish(self.topics.task(entry.device_id), frame, qos=QOS)

    def wait(self, deadline: float, want: int) -> Delivery:
        while True:
            self._pump(0.0)
            remaining = deadline - self.clock.now()
            if len(self._ready) >= want or remaining <= 0 or self.idle():
                break
            if self._ready or self._dropped or self._rejected:
                break  # hand over what arrived; the coordinator calls again
            self._pump(min(remaining, 0.25))
        delivery = Delivery(self._ready, self._dropped, self._rejected)
        self._ready, self._dropped, self._rejected = [], [], []
        return delivery

    def idle(self) -> bool:
        return not any(self._tasks[t].state == "pending" for t in self._open.values())

    def cancel(self, round_index: int) -> None:
        for device_id, task_id in list(self._open.items()):
            entry = self._tasks[task_id]
            if entry.round == round_index:
                entry.state = "cancelled" if entry.state in ("pending", "dropped") else entry.state
                entry.frames = []
                del self._open[device_id]
                self._inbound.pop(device_id, None)
        self._held = {k: r for k, r in self._held.items() if r.round > round_index}
        self.publish_status("aggregating", round_index)

    # -- inbox -----------------------------------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        """Handle one message (waiting up to `timeout` for it), then everything else already queued."""
        try:
            item = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            item = None
        while item is not None:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None
        self._tick()

    def _handle(self, topic: str, payload: bytes, arrived: float, retained: bool = False) -> None:
        device_id = "?"
        try:
            parsed = parse_topic(topic)
            if parsed.fleet != self.topics.fleet or parsed.device_id is None:
                return
            device_id = parsed.device_id
            if not payload and topic in self._cleared:
                self._cleared.discard(topic)
                return  # the echo of a retained message we cleared below
            if retained and payload:
                self._drop_retained(topic, device_id)
                return
            if parsed.channel == HELLO:
                self._on_hello(device_id, payload, arrived)
            elif parsed.channel == STATUS:
                self._on_status(device_id, payload, arrived)
            elif parsed.channel == RESULT_CHANNEL:
                self._on_result_frame(device_id, payload)
        except WireError as exc:
            self._reject(device_id, wire_reason(exc), detail=str(exc))
        except NestlingError as exc:
            self._reject(device_id, "malformed", detail=str(exc))
        except Exception:  # the round loop must survive anything a peer sends; the counter makes it visible
            log.exception("internal error handling a message on %r", topic)
            self._reject(device_id, "internal_error")

    def _drop_retained(self, topic: str, device_id: str) -> None:
        """A retained frame is from before this server existed: never act on it, and clear it from the
        broker so no later server does either. The board's live messages follow soon enough."""
        self.counters["ignored_retained"] += 1
        log.info("ignored and cleared a retained message of %s on %s", device_id, topic)
        if len(self._cleared) > 10_000:
            self._cleared.clear()
        self._cleared.add(topic)
        self.client.publish(topic, b"", qos=QOS, retain=True)

    def reopen(self, task_id: str) -> None:
        """The coordinator refused this result for a reason the board can fix: a corrected one is welcome."""
        entry = self._tasks.get(task_id)
        if entry is not None and entry.state == "accepted":
            entry.state = "pending"
            held = self._held.pop(task_id, None)
            if held is not None:
                entry.state = "accepted"
                self._ready.append(held)

    def _reject(self, device_id: str, reason: str, *, detail: str = "", key: str | None = None) -> None:
        if key is not None and not self._counted.add(key):
            return  # one rejection per transfer, not per chunk
        self.counters[f"rejected_{reason}"] += 1
        self._rejected.append((device_id, reason))
        log.info("rejected message from %s: %s %s", device_id, reason, detail[:200])

    def _on_hello(self, device_id: str, payload: bytes, arrived: float) -> None:
        sender, profile = decode_hello(payload)
        if sender != device_id:
            raise WireError(f"hello on {device_id}'s topic names device {sender!r}")
        self.registry.register(device_id, profile, arrived)
        self._resend_orders([device_id])

    def _on_status(self, device_id: str, payload: bytes, arrived: float) -> None:
        if bytes(payload) == OFFLINE:
            self._device_gone(device_id)
            return
        status = decode_status(payload)
        if status.device_id != device_id:
            raise WireError(f"status on {device_id}'s topic names device {status.device_id!r}")
        if not self.registry.known(device_id):
            self._rehello(device_id)
            return
        self.registry.heartbeat(device_id, status.state, arrived)  # liveness as of arrival, not of handling

    def _device_gone(self, device_id: str) -> None:
        if self.registry.offline(device_id):
            log.info("device %s went offline", device_id)
        task_id = self._open.get(device_id)
        if task_id is not None and self._tasks[task_id].state == "pending":
            self._tasks[task_id].state = "dropped"  # its result is still welcome if it comes back in time
            self._dropped.append(device_id)
            self.counters["dropouts"] += 1

    def _rehello(self, device_id: str) -> None:
        now = time.monotonic()
        if now - self._rehello_at.get(device_id, -1e9) >= self.settings.rehello_every_s:
            if len(self._rehello_at) > 10_000:  # a flood of made-up device ids must not grow this forever
                self._rehello_at.clear()
            self._rehello_at[device_id] = now
            self.client.publish(self.topics.ctrl(device_id), encode_rehello(self.session), qos=QOS)

    # -- results ---------------------------------------------------------------------------------
    def _on_result_frame(self, device_id: str, payload: bytes) -> None:
        if not self.registry.known(device_id):
            self._rehello(device_id)
            self._reject(device_id, "unknown_device")
            return
        header = read_header(payload, max_bytes=self.settings.max_message_bytes + RESULT_SLACK_BYTES)
        kind = header["kind"]
        if kind == CHUNK_REQUEST_KIND:  # the device lost chunks of its task (or of its export order)
            now = time.monotonic()
            if now - self._chunk_answered_at.get(device_id, -1e9) < self.settings.chunk_answer_every_s:
                self._reject(
                    device_id, "throttled", detail="chunk re-request"
                )  # a looping board must not flood
                return
            if len(self._chunk_answered_at) > 10_000:
                self._chunk_answered_at.clear()
            self._chunk_answered_at[device_id] = now
            export = header.get("transfer_id") in self.exports.transfers
            topic = self.topics.ctrl(device_id) if export else self.topics.task(device_id)
            for frame in self._outbound.answer(payload, device_id):
                self.client.publish(topic, frame, qos=QOS)
            self.counters["export_chunks_resent" if export else "task_chunks_resent"] += 1
            return
        if kind == EXPORT_REPORT:
            self._on_export_report(device_id, payload)
            return
        if kind not in (CHUNK_KIND, RESULT):
            raise WireError(f"unexpected message kind {kind!r} on a result topic")
        inbound = self._inbound.get(device_id)
        if inbound is None:  # no open task: say why without buffering anything
            reason = unsolicited_reason(device_id, self._tasks.values())
            self._reject(device_id, reason, key=header.get("transfer_id"))
            return
        if kind == CHUNK_KIND:
            try:
                whole = inbound.add(payload)
            except WireError as exc:
                self._reject(device_id, wire_reason(exc), detail=str(exc), key=header.get("transfer_id"))
                return
            if whole is None:
                return
            payload = whole
        self._on_result(device_id, payload, inbound.max_payload_bytes)

    def _on_result(self, device_id: str, payload: bytes, limit: int) -> None:
        result, session = decode_result(decode_message(payload, max_bytes=limit))
        entry = self._tasks.get(result.task_id)
        reason = check_result(device_id, result, session, self.session, entry, self.current_round)
        if reason == "duplicate" and entry is not None and entry.round == self.current_round:
            # The delivered result may still be refused by the coordinator (reopen below): keep the newest
            # later one, so a board's corrected result is not lost to a race with that verdict.
            self._held[result.task_id] = result
        if reason is not None:
            self._reject(device_id, reason, detail=f"task {result.task_id} round {result.round}")
            return
        assert entry is not None
        entry.state, entry.frames = "accepted", []
        self.counters["accepted"] += 1
        self.trained_by.setdefault(result.spec_id, set()).add(device_id)
        self._ready.append(result)

    # -- end-of-run exports ----------------------------------------------------------------------
    def send_exports(self, orders: list[ExportOrder]) -> None:
        """Publish each export order on its device's ctrl topic, chunked like a task (it holds weights)."""
        for order in orders:
            frames = self._outbound.frames(encode_export_order(order, self.session), order.device_id)
            header = read_header(frames[0])
            self.exports.sent(order, header.get("transfer_id") if header["kind"] == CHUNK_KIND else None)
            self._export_frames[order.device_id] = frames
            self._publish_order(order.device_id)
        self.counters["export_orders"] += len(orders)

    def _publish_order(self, device_id: str) -> None:
        for frame in self._export_frames[device_id]:
            self.client.publish(self.topics.ctrl(device_id), frame, qos=QOS)

    def _resend_orders(self, device_ids: list[str]) -> None:
        """Send an order again when it may have been lost whole: the server reconnected, or the board
        registered anew (it restarted, forgetting the order). A board still exporting ignores the repeat
        and one that finished answers it with its report again."""
        for device_id in device_ids:
            if device_id in self._export_frames:  # dropped once its report is admitted
                self._publish_order(device_id)
                self.counters["export_orders_resent"] += 1

    def wait_exports(self, timeout_s: float) -> dict[str, ExportReport]:
        """Handle messages until every ordered device reported or `timeout_s` passed; the admitted reports."""
        give_up = time.monotonic() + timeout_s
        while self.exports.pending() and time.monotonic() < give_up:
            self._pump(min(0.2, max(0.0, give_up - time.monotonic())))
        return dict(self.exports.reports)

    def _on_export_report(self, device_id: str, payload: bytes) -> None:
        report, session = decode_export_report(payload)  # WireError: counted and logged by _handle
        reason = self.exports.admit(device_id, report, session, self.session)
        if reason is not None:
            self._reject(device_id, reason, detail=f"export report {report.order_id}")
            return
        self.counters["export_reports"] += 1
        self._export_frames.pop(device_id, None)
        log.info("export report from %s: %s %s", device_id, report.status, report.bundle or report.error)

    # -- timers ----------------------------------------------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        if now < self._next_tick:
            return
        self._next_tick = now + 0.2
        if self._reconnected.is_set():
            self._reconnected.clear()
            for task_id in self._open.values():  # agents drop repeats of tasks they already have
                self._send_task(self._tasks[task_id])
                self.counters["tasks_resent"] += 1
            self._resend_orders(list(self._export_frames))
        for device_id in self.registry.expire(self.clock.now()):
            self._device_gone(device_id)
        for device_id, inbound in list(self._inbound.items()):
            for request in inbound.requests():
                self.client.publish(self.topics.ctrl(device_id), request, qos=QOS)
                self.counters["rerequests"] += 1
            for transfer_id in inbound.expired():
                self._reject(device_id, "missing_chunks", key=transfer_id)

    def _forget_before(self, round_index: int | None) -> None:
        """Keep two rounds of task records: enough to tell late from stale, bounded in memory."""
        if round_index is None:
            return
        self._tasks = {k: e for k, e in self._tasks.items() if e.round >= round_index - 1}
