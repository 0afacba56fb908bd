"""The end-of-run export campaign: send each board its export order, resend lost ones, admit the reports.

An order is chunked like a task (it holds the board's final weights) and goes out on the board's ctrl
topic. It is sent again when it may have been lost whole: the server reconnected, or the board
registered anew (it restarted, forgetting the order). A board still exporting ignores the repeat and
one that finished answers it with its report again. The ledger (server/deployables.py) judges reports.
"""

from __future__ import annotations

import logging
from collections import Counter

from nestling.server.chunk_exchange import ChunkExchange
from nestling.server.deployables import ExportLedger
from nestling.server.mqtt_link import MqttLink
from nestling.wire.codec import CHUNK_KIND, read_header
from nestling.wire.export_messages import ExportOrder, ExportReport, decode_export_report, encode_export_order

log = logging.getLogger("nestling.mqtt")


class ExportCampaign:
    """The orders sent, their frames (kept until the board's report is admitted) and the ledger."""

    def __init__(self, link: MqttLink, chunks: ChunkExchange, session: str, counters: Counter[str]) -> None:
        self.link = link
        self.chunks = chunks
        self.session = session
        self.counters = counters
        self.ledger = ExportLedger()
        self._frames: dict[str, list[bytes]] = {}  # device id → its order's frames, until it reports

    def send(self, orders: list[ExportOrder]) -> None:
        for order in orders:
            frames = self.chunks.frames(encode_export_order(order, self.session), order.device_id)
            header = read_header(frames[0])
            self.ledger.sent(order, header.get("transfer_id") if header["kind"] == CHUNK_KIND else None)
            self._frames[order.device_id] = frames
            self._publish(order.device_id)
        self.counters["export_orders"] += len(orders)

    def owns(self, transfer_id: object) -> bool:
        """True when a board's chunk re-request is about an export order (not a task)."""
        return transfer_id in self.ledger.transfers

    def _publish(self, device_id: str) -> None:
        for frame in self._frames[device_id]:
            self.link.publish(self.link.topics.ctrl(device_id), frame)

    def resend(self, device_ids: list[str]) -> None:
        """Send again the orders of these boards that have not reported yet."""
        for device_id in device_ids:
            if device_id in self._frames:  # dropped once its report is admitted
                self._publish(device_id)
                self.counters["export_orders_resent"] += 1

    def resend_all(self) -> None:
        self.resend(list(self._frames))

    def admit(self, device_id: str, payload: bytes) -> tuple[ExportReport, str | None]:
        """Decode a board's report (WireError when malformed) and judge it: (report, refusal reason or None)."""
        report, session = decode_export_report(payload)
        reason = self.ledger.admit(device_id, report, session, self.session)
        if reason is None:
            self.counters["export_reports"] += 1
            self._frames.pop(device_id, None)
            log.info("export report from %s: %s %s", device_id, report.status, report.bundle or report.error)
        return report, reason
