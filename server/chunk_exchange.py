"""The server's end of chunked transfers: tasks and export orders out, results reassembled in.

Sent frames are kept (nestling.wire.transfers.Outbound) to answer a board's re-request for chunks it
lost; each board's inbound result is reassembled and its gaps re-requested on the board's ctrl topic,
with a bounded number of attempts before the transfer is given up.
"""

from __future__ import annotations

import time
from collections import Counter

from nestling.server.mqtt_link import MqttLink
from nestling.wire.transfers import Inbound, Outbound


class ChunkExchange:
    """Outbound frames per board and at most one inbound result transfer per board."""

    def __init__(
        self,
        link: MqttLink,
        counters: Counter[str],
        *,
        chunk_size: int,
        stall_s: float,
        max_rerequests: int,
        transfer_ttl_s: float,
        answer_every_s: float,
    ) -> None:
        self.link = link
        self.counters = counters
        self.stall_s = stall_s
        self.max_rerequests = max_rerequests
        self.transfer_ttl_s = transfer_ttl_s
        self.answer_every_s = answer_every_s
        self._outbound = Outbound(chunk_size)
        self._inbound: dict[str, Inbound] = {}
        self._answered_at: dict[str, float] = {}  # device -> when its last chunk re-request was answered

    def frames(self, payload: bytes, device_id: str) -> list[bytes]:
        """`payload` as frames to publish (chunked when large; those chunks are kept for re-requests)."""
        return self._outbound.frames(payload, device_id)

    def answer(self, device_id: str, request: bytes, topic: str) -> bool:
        """Resend on `topic` the chunks a board asks for again; False when it asked too soon after the last."""
        now = time.monotonic()
        if now - self._answered_at.get(device_id, -1e9) < self.answer_every_s:
            return False  # a looping board must not flood
        if len(self._answered_at) > 10_000:
            self._answered_at.clear()
        self._answered_at[device_id] = now
        for frame in self._outbound.answer(request, device_id):
            self.link.publish(topic, frame)
        return True

    def expect(self, device_id: str, max_payload_bytes: int) -> None:
        """Open (or replace) the inbound transfer of `device_id`'s next result."""
        self._inbound[device_id] = Inbound(
            max_payload_bytes,
            stall_s=self.stall_s,
            max_attempts=self.max_rerequests,
            ttl_s=self.transfer_ttl_s,
        )

    def inbound(self, device_id: str) -> Inbound | None:
        return self._inbound.get(device_id)

    def forget(self, device_id: str) -> None:
        self._inbound.pop(device_id, None)

    def tick(self) -> list[tuple[str, str]]:
        """Re-request stalled transfers' missing chunks; the (device, transfer id) pairs given up on."""
        given_up = []
        for device_id, inbound in list(self._inbound.items()):
            for request in inbound.requests():
                self.link.publish(self.link.topics.ctrl(device_id), request)
                self.counters["rerequests"] += 1
            given_up += [(device_id, transfer_id) for transfer_id in inbound.expired()]
        return given_up
