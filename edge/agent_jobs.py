"""The worker's queue: the newest task not yet started and an end-of-run export order.

Only the newest task is trained when several queue up (an older one's round has closed), and an export
order comes first: once the run is over a task still queued is stale.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from nestling.messages import Task
from nestling.wire.export_messages import ExportOrder


@dataclass(frozen=True)
class TrainJob:
    task: Task
    session: str  # the server session that sent it: the result is addressed to it
    received: float  # when its download began (monotonic), for an emulated board's pacing


@dataclass(frozen=True)
class ExportJob:
    order: ExportOrder
    session: str


class AgentJobs:
    """Filled by the control thread, drained by the worker thread."""

    def __init__(self, stopping: threading.Event) -> None:
        self._stopping = stopping
        self._ready = threading.Condition()
        self._task: TrainJob | None = None
        self._export: ExportJob | None = None

    def offer_task(self, job: TrainJob) -> None:
        with self._ready:
            queued = self._task
            if queued is None or job.task.round >= queued.task.round or job.session != queued.session:
                self._task = job  # an older queued task is superseded: its round has closed
            self._ready.notify()

    def offer_export(self, job: ExportJob) -> None:
        with self._ready:
            self._export = job
            self._ready.notify()

    def take(self) -> TrainJob | ExportJob | None:
        """The next job, waiting for one; None once the agent stops."""
        with self._ready:
            while self._task is None and self._export is None and not self._stopping.is_set():
                self._ready.wait(0.5)
            if self._stopping.is_set():
                return None
            job: TrainJob | ExportJob | None
            if self._export is not None:
                job, self._export = self._export, None
            else:
                job, self._task = self._task, None
            return job

    def wake(self) -> None:
        """Let a waiting worker see that the agent stops."""
        with self._ready:
            self._ready.notify_all()
