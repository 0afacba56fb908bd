"""The server's retained status (server/status): its session, phase, round and the plan boards profile.

Agents learn the server's session from it and resend a result when they see their round announced
again, so it is re-published after every reconnect.
"""

from __future__ import annotations

from typing import Any

import paho.mqtt.client as mqtt

from nestling.wire.fleet_messages import ServerStatus, encode_server_status
from nestling.wire.topics import QOS


class ServerStatusPublisher:
    """Holds what server/status says and publishes it, retained."""

    def __init__(self, client: mqtt.Client, topic: str, session: str) -> None:
        self.client = client
        self.topic = topic
        self.session = session
        self.phase = "waiting"
        self.round: int | None = None
        self.plan: dict[str, Any] | None = None  # what boards profile (ServerStatus.plan), set by the fleet
        self._sent: mqtt.MQTTMessageInfo | None = None

    def announce(self, phase: str, round_index: int | None = None) -> None:
        """A new phase (and round, when given), published at once."""
        self.phase = phase
        if round_index is not None:
            self.round = round_index
        self.publish()

    def publish(self) -> None:
        payload = encode_server_status(ServerStatus(self.session, self.phase, self.round, self.plan))
        self._sent = self.client.publish(self.topic, payload, qos=QOS, retain=True)

    def settle(self, timeout_s: float) -> None:
        """Wait (bounded) until the last status reached the broker: it stays retained after we leave."""
        if self._sent is not None and self.client.is_connected():
            self._sent.wait_for_publish(timeout_s)
