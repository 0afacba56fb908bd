"""MqttTransport: the coordinator's Transport over an MQTT broker (tasks out, results in, dropouts).

It composes one object per job: the connection and its inbox (server/mqtt_link.py), the server's
retained status (server/status_publisher.py), fleet membership (server/fleet_membership.py), chunked
transfers (server/chunk_exchange.py) and the end-of-run export campaign (server/export_campaign.py);
this class keeps the round's tasks and admits results. paho's network thread only queues incoming
messages; everything else (decoding, checks, registry, re-requests) runs on the coordinator's thread
inside `devices()` / `wait()`, so no state needs locks and a hostile message can at worst be counted,
never crash the round loop.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt

from nestling.errors import NestlingError, WireError
from nestling.messages import Result, Task
from nestling.server.chunk_exchange import ChunkExchange
from nestling.server.clock import Clock
from nestling.server.deployables import ExportLedger
from nestling.server.export_campaign import ExportCampaign
from nestling.server.fleet_admission import (
    Dispatched,
    RecentKeys,
    check_result,
    unsolicited_reason,
    wire_reason,
)
from nestling.server.fleet_membership import FleetMembership
from nestling.server.mqtt_link import MqttLink
from nestling.server.registry import DeviceRegistry
from nestling.server.status_publisher import ServerStatusPublisher
from nestling.server.strategies.base import DeviceInfo
from nestling.server.transport import Delivery
from nestling.wire.broker_settings import BrokerSettings
from nestling.wire.chunking import DEFAULT_CHUNK_SIZE
from nestling.wire.codec import (
    CHUNK_KIND,
    CHUNK_REQUEST_KIND,
    DEFAULT_MAX_MESSAGE_BYTES,
    decode_message,
    read_header,
)
from nestling.wire.export_messages import EXPORT_REPORT, ExportOrder, ExportReport
from nestling.wire.fleet_messages import RESULT, decode_result, encode_task
from nestling.wire.topics import HELLO, OFFLINE, STATUS, FleetTopics, parse_topic
from nestling.wire.topics import RESULT as RESULT_CHANNEL

log = logging.getLogger("nestling.mqtt")

RESULT_SLACK_BYTES = 1024 * 1024  # a result may exceed its task's encoded size by its header, no more


def server_client(broker: BrokerSettings, topics: FleetTopics) -> mqtt.Client:
    """The server's paho client: its fleet's id, a last will on server/status, and a clean session.

    Clean, so a restarted server never acts on what was queued for it while it was down (a hello that made an
    earlier server fail would otherwise come back on every start). Nothing honest is lost: boards resend their
    result when the round is re-announced (every (re)connect announces it), tasks are resent on reconnect, and a
    heartbeat from a board the server does not know gets a rehello."""
    return broker.client(
        f"nestling-{topics.fleet}-server", will=(topics.server_status, OFFLINE, True), clean_session=True
    )


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
        self.topics = topics
        self.registry = registry
        self.clock = clock
        self.settings = settings = settings or TransportSettings()
        self.session = uuid.uuid4().hex[:16]
        self.counters: Counter[str] = Counter()
        self.trained_by: dict[str, set[str]] = {}  # spec id → devices whose results of it were accepted
        self.status = ServerStatusPublisher(client, topics.server_status, self.session)
        self.link = MqttLink(
            client,
            topics,
            clock,
            self.counters,
            session=self.session,
            max_inflight=settings.max_inflight,
            on_connected=self.status.publish,  # re-announce after every (re)connect: the broker may have lost it
        )
        self.chunks = ChunkExchange(
            self.link,
            self.counters,
            chunk_size=settings.chunk_size,
            stall_s=settings.stall_s,
            max_rerequests=settings.max_rerequests,
            transfer_ttl_s=settings.transfer_ttl_s,
            answer_every_s=settings.chunk_answer_every_s,
        )
        self.campaign = ExportCampaign(self.link, self.chunks, self.session, self.counters)
        self.membership = FleetMembership(
            registry,
            self.link,
            self.session,
            rehello_every_s=settings.rehello_every_s,
            on_registered=lambda device_id: self.campaign.resend([device_id]),
            on_gone=self._drop_task_of,
        )
        self._tasks: dict[str, Dispatched] = {}
        self._open: dict[str, str] = {}  # device id → task id it holds in the current round
        self._ready: list[Result] = []
        self._dropped: list[str] = []
        self._rejected: list[tuple[str, str]] = []
        self._counted = RecentKeys()
        self._held: dict[str, Result] = {}  # task id -> a later result, kept until the first is judged
        self._next_tick = 0.0

    @property
    def plan(self) -> dict[str, Any] | None:
        """What boards profile (ServerStatus.plan), set by the fleet before round 0."""
        return self.status.plan

    @plan.setter
    def plan(self, plan: dict[str, Any] | None) -> None:
        self.status.plan = plan

    @property
    def exports(self) -> ExportLedger:
        """End-of-run export orders and the boards' reports."""
        return self.campaign.ledger

    def connect(self, host: str, port: int, timeout_s: float = 30.0) -> None:
        """Connect and return once the fleet's topics are subscribed (ConfigError if the broker refuses)."""
        self.link.connect(host, port, timeout_s)

    def publish_status(self, phase: str, round_index: int | None = None) -> None:
        """Retained server/status: what the server is doing (agents also learn its session from it)."""
        self.status.announce(phase, round_index)

    def close(self) -> None:
        """Leave cleanly: the last status stays retained (no last will), then the network thread ends."""
        self.status.settle(2.0)
        self.link.close()
        self.registry.compact()  # one snapshot for `nestling plan --fleet` and the next start

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
            self.status.round = task.round
            payload = encode_task(task, self.session)
            entry = Dispatched.of(task, len(payload) + RESULT_SLACK_BYTES)
            entry.frames = self.chunks.frames(payload, task.device_id)
            self._tasks[task.task_id] = entry
            self._open[task.device_id] = task.task_id
            self.chunks.expect(task.device_id, min(entry.limit, self.settings.max_message_bytes))
            self._send_task(entry)
        self._forget_before(self.status.round)
        self.counters["dispatched"] += len(tasks)

    def _send_task(self, entry: Dispatched) -> None:
        for frame in entry.frames:
            self.link.publish(self.topics.task(entry.device_id), frame)

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
                entry.state = "cancelled" if entry.state in ("pending", "dropped", "refused") else entry.state
                entry.frames = []
                del self._open[device_id]
                self.chunks.forget(device_id)
        self._held = {k: r for k, r in self._held.items() if r.round > round_index}
        self.publish_status("aggregating", round_index)

    def reopen(self, task_id: str) -> None:
        """The coordinator refused this result: it is the board's answer (the round need not wait for it), but a
        corrected one is still welcome while the round is open."""
        entry = self._tasks.get(task_id)
        if entry is not None and entry.state == "accepted":
            entry.state = "refused"
            held = self._held.pop(task_id, None)
            if held is not None:
                entry.state = "accepted"
                self._ready.append(held)

    # -- end-of-run exports ----------------------------------------------------------------------
    def send_exports(self, orders: list[ExportOrder]) -> None:
        """Publish each export order on its device's ctrl topic, chunked like a task (it holds weights)."""
        self.campaign.send(orders)

    def wait_exports(self, timeout_s: float) -> dict[str, ExportReport]:
        """Handle messages until every ordered device reported or `timeout_s` passed; the admitted reports."""
        give_up = time.monotonic() + timeout_s
        while self.exports.pending() and time.monotonic() < give_up:
            self._pump(min(0.2, max(0.0, give_up - time.monotonic())))
        return dict(self.exports.reports)

    # -- inbox -----------------------------------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        """Handle one message (waiting up to `timeout` for it), then everything else already queued."""
        for item in self.link.arrivals(timeout):
            self._handle(*item)
        self._tick()

    def _handle(self, topic: str, payload: bytes, arrived: float, retained: bool = False) -> None:
        device_id = "?"
        try:
            parsed = parse_topic(topic)
            if parsed.fleet != self.topics.fleet or parsed.device_id is None:
                return
            device_id = parsed.device_id
            if not self.link.fresh(topic, payload, retained, device_id):
                return
            if parsed.channel == HELLO:
                self.membership.on_hello(device_id, payload, arrived)
            elif parsed.channel == STATUS:
                self.membership.on_status(device_id, payload, arrived)
            elif parsed.channel == RESULT_CHANNEL:
                self._on_result_frame(device_id, payload)
        except WireError as exc:
            self._reject(device_id, wire_reason(exc), detail=str(exc))
        except NestlingError as exc:
            self._reject(device_id, "malformed", detail=str(exc))
        except Exception:  # the round loop must survive anything a peer sends; the counter makes it visible
            log.exception("internal error handling a message on %r", topic)
            self._reject(device_id, "internal_error")

    def _reject(self, device_id: str, reason: str, *, detail: str = "", key: str | None = None) -> None:
        if key is not None and not self._counted.add(key):
            return  # one rejection per transfer, not per chunk
        self.counters[f"rejected_{reason}"] += 1
        self._rejected.append((device_id, reason))
        log.info("rejected message from %s: %s %s", device_id, reason, detail[:200])

    def _drop_task_of(self, device_id: str) -> None:
        """A board left: its pending task is dropped (its result is still welcome if it comes back in time)."""
        task_id = self._open.get(device_id)
        if task_id is not None and self._tasks[task_id].state == "pending":
            self._tasks[task_id].state = "dropped"
            self._dropped.append(device_id)
            self.counters["dropouts"] += 1

    # -- results ---------------------------------------------------------------------------------
    def _on_result_frame(self, device_id: str, payload: bytes) -> None:
        if not self.membership.known(device_id):
            self.membership.rehello(device_id)
            self._reject(device_id, "unknown_device")
            return
        header = read_header(payload, max_bytes=self.settings.max_message_bytes + RESULT_SLACK_BYTES)
        kind = header["kind"]
        if kind == CHUNK_REQUEST_KIND:  # the device lost chunks of its task (or of its export order)
            export = self.campaign.owns(header.get("transfer_id"))
            topic = self.topics.ctrl(device_id) if export else self.topics.task(device_id)
            if not self.chunks.answer(device_id, payload, topic):
                self._reject(device_id, "throttled", detail="chunk re-request")
                return
            self.counters["export_chunks_resent" if export else "task_chunks_resent"] += 1
            return
        if kind == EXPORT_REPORT:
            report, reason = self.campaign.admit(device_id, payload)  # WireError: counted by _handle
            if reason is not None:
                self._reject(device_id, reason, detail=f"export report {report.order_id}")
            return
        if kind not in (CHUNK_KIND, RESULT):
            raise WireError(f"unexpected message kind {kind!r} on a result topic")
        inbound = self.chunks.inbound(device_id)
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
        message = decode_message(payload, max_bytes=limit)  # a frame damaged on its way is not an answer ...
        try:
            result, session = decode_result(message)
        except WireError:
            self._answered_refused(device_id)  # ... but an intact one that breaks the schema is the board's
            raise
        entry = self._tasks.get(result.task_id)
        reason = check_result(device_id, result, session, self.session, entry, self.status.round)
        if reason == "duplicate" and entry is not None and entry.round == self.status.round:
            # The delivered result may still be refused by the coordinator (reopen below): keep the newest
            # later one, so a board's corrected result is not lost to a race with that verdict.
            self._held[result.task_id] = result
        if reason is not None:
            if reason in ("wrong_tensors", "non_finite"):
                self._answered_refused(device_id)
            self._reject(device_id, reason, detail=f"task {result.task_id} round {result.round}")
            return
        assert entry is not None
        entry.state, entry.frames = "accepted", []
        self.counters["accepted"] += 1
        self.trained_by.setdefault(result.spec_id, set()).add(device_id)
        self._ready.append(result)

    def _answered_refused(self, device_id: str) -> None:
        """The board's open task got an answer that was refused: the round need not wait for it any longer."""
        entry = self._tasks.get(self._open.get(device_id, ""))
        if entry is not None and entry.state == "pending":
            entry.state = "refused"

    # -- timers ----------------------------------------------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        if now < self._next_tick:
            return
        self._next_tick = now + 0.2
        if self.link.take_reconnected():
            for task_id in self._open.values():  # agents drop repeats of tasks they already have
                self._send_task(self._tasks[task_id])
                self.counters["tasks_resent"] += 1
            self.campaign.resend_all()
        self.membership.expire(self.clock.now())
        for device_id, transfer_id in self.chunks.tick():
            self._answered_refused(device_id)
            self._reject(device_id, "missing_chunks", key=transfer_id)

    def _forget_before(self, round_index: int | None) -> None:
        """Keep two rounds of task records: enough to tell late from stale, bounded in memory."""
        if round_index is None:
            return
        self._tasks = {k: e for k, e in self._tasks.items() if e.round >= round_index - 1}
