"""The board's end-of-run export: build its own deployable from the final weights, then report it.

TensorRT engines only run where they were built, so the board builds its bundle (edge/board_export.py,
imported only when an order arrives: onnx / onnxruntime load only on a board that exports). A repeated
order (the server lost our report, not we the order) is answered with the same report, not rebuilt.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from nestling.edge.agent_config import AgentConfig
from nestling.edge.agent_link import AgentLink
from nestling.edge.agent_presence import AgentPresence
from nestling.errors import WireError
from nestling.wire.export_messages import ExportOrder, encode_export_report

log = logging.getLogger("nestling.agent")


class AgentExports:
    """The order taken last, and its report once built (resent when the server repeats the order)."""

    def __init__(self, link: AgentLink, presence: AgentPresence, config: AgentConfig) -> None:
        self.link = link
        self.presence = presence
        self.config = config
        self.seen: tuple[str, str] | None = None  # (order id, session) of the order taken last
        self.report: bytes | None = None  # its encoded report

    def is_repeat(self, order: ExportOrder, session: str) -> bool:
        """True for the order taken last (its report, if built, is sent again); else it becomes that order."""
        if (order.order_id, session) == self.seen:
            if self.report is not None:
                self.link.publish_result(self.report)
            return True
        self.seen, self.report = (order.order_id, session), None
        return False

    def run(self, order: ExportOrder, session: str) -> None:
        """Build and report; on the worker thread, so heartbeats go on (state "exporting") meanwhile."""
        from nestling.edge.board_export import export_on_board

        self.presence.state = "exporting"
        self.presence.heartbeat()
        try:
            report = export_on_board(
                order,
                self.config.export,
                fleet=self.link.topics.fleet,
                device_id=self.link.device_id,
                data=self.config.data,
                threads=self.config.device.threads,
            )
        finally:
            self.presence.state = "online"
        try:
            payload = encode_export_report(report, session)
        except WireError as exc:  # e.g. a bundle path too long for the report: still answer, as a failure
            report = replace(report, status="failed", bundle=None, models=[], files={}, error=str(exc))
            payload = encode_export_report(report, session)
        self.report = payload
        self.link.publish_result(payload)
        log.info(
            "export of %s (%s): %s %s",
            order.name,
            report.spec_id,
            report.status,
            report.bundle or report.error,
        )
        self.presence.heartbeat()
