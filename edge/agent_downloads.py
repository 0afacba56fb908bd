"""Tasks and export orders in: chunks reassembled, gaps re-requested, when each download began.

Both arrive chunked when large (a task on the board's task topic, an export order on its ctrl topic);
one Inbound reassembles them and re-requests missing chunks on the result topic. The start of a task's
download is kept so an emulated board can pace the download it would have taken (edge/emulation.py).
"""

from __future__ import annotations

import logging
import time

from nestling.edge.agent_link import AgentLink
from nestling.errors import WireError
from nestling.messages import Task
from nestling.wire.codec import CHUNK_KIND, decode_message, read_header
from nestling.wire.export_messages import ExportOrder, decode_export_order
from nestling.wire.fleet_messages import decode_task
from nestling.wire.transfers import Inbound

log = logging.getLogger("nestling.agent")


class AgentDownloads:
    """Decodes whole tasks and export orders addressed to this board (WireError otherwise)."""

    def __init__(self, link: AgentLink, max_message_bytes: int, stall_s: float) -> None:
        self.link = link
        self.device_id = link.device_id
        self.inbound = Inbound(max_message_bytes, stall_s=stall_s)
        self._chunks_from: dict[str, float] = {}  # task transfer id → when its first chunk arrived

    def task(self, payload: bytes) -> tuple[Task, str, float] | None:
        """(task, server session, when its download began) once whole; None while chunks are missing."""
        header, received = read_header(payload), time.monotonic()
        if header["kind"] == CHUNK_KIND:
            if len(self._chunks_from) > 16:  # transfers given up on never complete: forget them
                self._chunks_from.clear()
            received = self._chunks_from.setdefault(
                header["transfer_id"], received
            )  # the download began here
            whole = self.inbound.add(payload)
            if whole is None:
                return None
            self._chunks_from.pop(header["transfer_id"], None)
            payload = whole
        task, session = decode_task(decode_message(payload, max_bytes=self.inbound.max_payload_bytes))
        if task.device_id != self.device_id:
            raise WireError(f"task {task.task_id} is for {task.device_id}, not {self.device_id}")
        return task, session, received

    def export_order(self, payload: bytes) -> tuple[ExportOrder, str] | None:
        """(order, server session) once whole; None while chunks are missing."""
        if read_header(payload)["kind"] == CHUNK_KIND:
            whole = self.inbound.add(payload)
            if whole is None:
                return None
            payload = whole
        order, session = decode_export_order(
            decode_message(payload, max_bytes=self.inbound.max_payload_bytes)
        )
        if order.device_id != self.device_id:
            raise WireError(f"export order {order.order_id} is for {order.device_id}, not {self.device_id}")
        return order, session

    def tick(self) -> None:
        """Re-request the missing chunks of stalled downloads; give up on the hopeless ones."""
        for request in self.inbound.requests():
            self.link.publish_result(request)
        for transfer_id in self.inbound.expired():
            log.warning("gave up on task transfer %s: chunks missing", transfer_id)
