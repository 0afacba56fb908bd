"""Who is in the fleet: hellos register boards, statuses keep them alive, last wills and silence drop them.

A board the server does not know (it registered with an earlier server) is asked to say hello again,
at most every `rehello_every_s`, so a flood of made-up device ids costs nothing but a counter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nestling.errors import WireError
from nestling.server.mqtt_link import MqttLink
from nestling.server.registry import DeviceRegistry
from nestling.wire.fleet_messages import decode_hello, decode_status, encode_rehello
from nestling.wire.topics import OFFLINE

log = logging.getLogger("nestling.mqtt")


class FleetMembership:
    """Keeps the DeviceRegistry in step with the boards' hello and status messages.

    `on_registered(device_id)` runs after each hello (a board that restarted may have lost an order);
    `on_gone(device_id)` after a board left (last will or missed heartbeats)."""

    def __init__(
        self,
        registry: DeviceRegistry,
        link: MqttLink,
        session: str,
        *,
        rehello_every_s: float,
        on_registered: Callable[[str], None],
        on_gone: Callable[[str], None],
    ) -> None:
        self.registry = registry
        self.link = link
        self.session = session
        self.rehello_every_s = rehello_every_s
        self._on_registered = on_registered
        self._on_gone = on_gone
        self._rehello_at: dict[str, float] = {}

    def known(self, device_id: str) -> bool:
        return self.registry.known(device_id)

    def on_hello(self, device_id: str, payload: bytes, arrived: float) -> None:
        self.registry.enrolment.check(device_id)  # a stranger is refused before its hello is even decoded
        sender, profile = decode_hello(payload)
        if sender != device_id:
            raise WireError(f"hello on {device_id}'s topic names device {sender!r}")
        self.registry.register(device_id, profile, arrived)
        self._on_registered(device_id)

    def on_status(self, device_id: str, payload: bytes, arrived: float) -> None:
        if bytes(payload) == OFFLINE:
            self.gone(device_id)
            return
        status = decode_status(payload)
        if status.device_id != device_id:
            raise WireError(f"status on {device_id}'s topic names device {status.device_id!r}")
        if not self.registry.known(device_id):
            self.rehello(device_id)
            return
        self.registry.heartbeat(device_id, status.state, arrived)  # liveness as of arrival, not of handling

    def expire(self, now: float) -> None:
        """Drop the boards whose heartbeats stopped (no last will reached us)."""
        for device_id in self.registry.expire(now):
            self.gone(device_id)

    def gone(self, device_id: str) -> None:
        if self.registry.offline(device_id):
            log.info("device %s went offline", device_id)
        self._on_gone(device_id)

    def rehello(self, device_id: str) -> None:
        """Ask an unknown board to register again (throttled per device); never a device that is not enrolled."""
        if not self.registry.enrolment.admits(device_id):
            return
        now = time.monotonic()
        if now - self._rehello_at.get(device_id, -1e9) >= self.rehello_every_s:
            if len(self._rehello_at) > 10_000:  # a flood of made-up device ids must not grow this forever
                self._rehello_at.clear()
            self._rehello_at[device_id] = now
            self.link.publish(self.link.topics.ctrl(device_id), encode_rehello(self.session))
