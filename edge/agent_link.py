"""The agent's MQTT connection: its last will, subscriptions, an inbox fed by paho's thread, publishing.

paho reconnects by itself; after every (re)connect the agent registers again (`on_connected`), since a
restarted broker or server has forgotten it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import paho.mqtt.client as mqtt

from nestling.wire.broker_settings import BrokerSettings
from nestling.wire.topics import OFFLINE, QOS, FleetTopics

log = logging.getLogger("nestling.agent")


class AgentLink:
    """One paho client for one board: reads its task and ctrl topics and server/status, writes its own."""

    def __init__(
        self,
        broker: BrokerSettings,
        device_id: str,
        stopping: threading.Event,
        on_connected: Callable[[], None],
    ) -> None:
        self.broker = broker
        self.device_id = device_id
        self.topics = FleetTopics(broker.fleet)
        self._stopping = stopping
        self._on_connected = on_connected
        self._inbox: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
        self.client = broker.client(
            f"nestling-{self.topics.fleet}-{device_id}",
            will=(self.topics.status(device_id), OFFLINE, True),
        )
        self.client.max_inflight_messages_set(64)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = lambda _c, _u, msg: self._inbox.put((msg.topic, bytes(msg.payload)))
        self.connected = threading.Event()  # what the agent's "waiting for ..." notices read

    def start(self) -> None:
        host, port = self.broker.host_port
        self.client.connect_async(host, port, keepalive=15)
        self.client.loop_start()  # retries the first connection too: the broker may come up later

    def _on_connect(
        self, client: mqtt.Client, userdata: object, flags: object, reason: object, properties: object
    ) -> None:
        if getattr(reason, "is_failure", False):
            log.error("broker refused %s: %s", self.device_id, reason)
            return
        client.subscribe(
            [
                (self.topics.task(self.device_id), QOS),
                (self.topics.ctrl(self.device_id), QOS),
                (self.topics.server_status, QOS),
            ]
        )
        self.connected.set()
        self._on_connected()
        # Registered is the server's word, not ours: the agent says so when a server status arrives.
        log.info("%s connected to the broker at %s; hello sent", self.device_id, self.broker.url)

    def _on_disconnect(self, *args: object) -> None:
        self.connected.clear()
        if not self._stopping.is_set():
            log.warning("lost the broker; paho reconnects by itself")

    def next_message(self, timeout: float) -> tuple[str, bytes] | None:
        """The next (topic, payload) that arrived, waiting up to `timeout`; None when nothing did."""
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def publish_hello(self, payload: bytes) -> None:
        self.client.publish(self.topics.hello(self.device_id), payload, qos=QOS)

    def publish_status(self, payload: bytes) -> None:
        """This board's status, retained: the server learns it at once after a restart."""
        self.client.publish(self.topics.status(self.device_id), payload, qos=QOS, retain=True)

    def publish_result(self, payload: bytes) -> None:
        """Results, export reports and chunk re-requests: the only topic a board may write data to."""
        self.client.publish(self.topics.result(self.device_id), payload, qos=QOS)

    def leave(self) -> None:
        """Mark this device offline (as the last will would) and disconnect."""
        if self.client.is_connected():
            self.client.publish(
                self.topics.status(self.device_id), OFFLINE, qos=QOS, retain=True
            ).wait_for_publish(2.0)
        self.client.disconnect()
        self.client.loop_stop()
