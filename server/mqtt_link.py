"""The server's MQTT connection: subscriptions, an inbox fed by paho's thread, publishing, stale retained frames.

paho's network thread only queues what arrives (with its arrival time); the coordinator's thread drains
the queue, so nothing behind this class needs a lock.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterator

import paho.mqtt.client as mqtt

from nestling.errors import ConfigError
from nestling.server.clock import Clock
from nestling.wire.client import connect_and_wait
from nestling.wire.topics import HELLO, QOS, STATUS, FleetTopics
from nestling.wire.topics import RESULT as RESULT_CHANNEL

log = logging.getLogger("nestling.mqtt")

Arrival = tuple[str, bytes, float, bool]  # topic, payload, arrival time (server clock), retained flag


class MqttLink:
    """One paho client subscribed to every device's hello, status and result topics.

    `on_connected` runs after every (re)connect, once the subscriptions are asked for (the server
    re-announces its status there: the broker may have lost it)."""

    def __init__(
        self,
        client: mqtt.Client,
        topics: FleetTopics,
        clock: Clock,
        counters: Counter[str],
        *,
        session: str,
        max_inflight: int,
        on_connected: Callable[[], None],
    ) -> None:
        self.client = client
        self.topics = topics
        self.counters = counters
        self.session = session  # only named in the log
        self._on_connected = on_connected
        self._inbox: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        self._cleared: set[str] = (
            set()
        )  # topics whose retained frame we cleared (their empty echo is ignored)
        self._subscribed = threading.Event()
        self._connections = 0
        self._reconnected = threading.Event()
        client.max_inflight_messages_set(max_inflight)  # chunks stream without waiting per ack
        client.on_connect = self._on_connect
        client.on_subscribe = lambda *_: self._subscribed.set()
        client.on_message = lambda _c, _u, msg: self._inbox.put(
            (msg.topic, bytes(msg.payload), clock.now(), bool(msg.retain))
        )

    def _on_connect(
        self, client: mqtt.Client, userdata: object, flags: object, reason: object, properties: object
    ) -> None:
        if getattr(reason, "is_failure", False):
            log.warning("broker refused the server: %s", reason)
            return
        client.subscribe([(self.topics.all_devices(c), QOS) for c in (HELLO, STATUS, RESULT_CHANNEL)])
        self._on_connected()
        self._connections += 1
        if self._connections > 1:
            self._reconnected.set()  # tasks sent while we were away may be lost: the transport resends
        log.info("server connected to the broker (session %s)", self.session)

    def connect(self, host: str, port: int, timeout_s: float) -> None:
        """Connect and return once the fleet's topics are subscribed (ConfigError if the broker refuses)."""
        connect_and_wait(self.client, host, port, timeout_s=timeout_s)
        if not self._subscribed.wait(timeout_s):
            raise ConfigError(f"MQTT broker {host}:{port} did not confirm the server's subscriptions")

    def take_reconnected(self) -> bool:
        """True once after each reconnect: what was published while away may be lost."""
        if not self._reconnected.is_set():
            return False
        self._reconnected.clear()
        return True

    def publish(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=QOS)

    def arrivals(self, timeout: float) -> Iterator[Arrival]:
        """One message (waiting up to `timeout` for it), then everything else already queued."""
        try:
            item = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            yield item
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def fresh(self, topic: str, payload: bytes, retained: bool, device_id: str) -> bool:
        """False for frames not to act on: the echo of a retained frame we cleared, and retained frames.

        A retained frame is from before this server existed: never act on it, and clear it from the
        broker so no later server does either. The board's live messages follow soon enough."""
        if not payload and topic in self._cleared:
            self._cleared.discard(topic)
            return False
        if retained and payload:
            self.counters["ignored_retained"] += 1
            log.info("ignored and cleared a retained message of %s on %s", device_id, topic)
            if len(self._cleared) > 10_000:
                self._cleared.clear()
            self._cleared.add(topic)
            self.client.publish(topic, b"", qos=QOS, retain=True)
            return False
        return True

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
