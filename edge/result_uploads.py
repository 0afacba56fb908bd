"""Results out: chunked uploads, chunks re-sent when the server asks, the last result kept for an outage.

The server applies a result once whatever arrives, so resending is always safe: when it sends the same
task again (it lost our answer, not we the task) or re-announces the round we answered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nestling.edge.agent_link import AgentLink
from nestling.messages import Task
from nestling.wire.transfers import Outbound

log = logging.getLogger("nestling.agent")


@dataclass(frozen=True)
class SentResult:
    task_id: str
    round: int
    session: str
    frames: list[bytes]


class ResultUploads:
    """The frames of recent results (to answer chunk re-requests) and the last result sent."""

    def __init__(self, link: AgentLink, chunk_bytes: int) -> None:
        self.link = link
        self.outbound = Outbound(chunk_bytes, max_transfers=4)
        self.sent: SentResult | None = None  # written by the worker thread, read by the control thread

    def prepare(self, payload: bytes, task: Task, session: str) -> list[bytes]:
        """The frames of an encoded result, kept as the last result from now on."""
        frames = self.outbound.frames(payload, "server")
        self.sent = SentResult(task.task_id, task.round, session, frames)
        return frames

    def send(self, frames: list[bytes]) -> None:
        for frame in frames:
            self.link.publish_result(frame)

    def answer(self, request: bytes) -> None:
        """Send again the chunks the server asks for."""
        self.send(self.outbound.answer(request, "server"))

    def resend_for_task(self, task_id: str, session: str) -> bool:
        """Resend the last result when it answers this task (the server sent the task again); True if so."""
        sent = self.sent
        if sent is None or (sent.task_id, sent.session) != (task_id, session):
            return False
        self._resend(sent)
        return True

    def resend_for_round(self, round_index: int | None, session: str) -> None:
        """Resend the last result when it answers this round (the server re-announced it after an outage)."""
        sent = self.sent
        if sent is not None and (sent.round, sent.session) == (round_index, session):
            self._resend(sent)

    def _resend(self, sent: SentResult) -> None:
        log.info("re-sending the result of %s", sent.task_id)
        self.send(sent.frames)
