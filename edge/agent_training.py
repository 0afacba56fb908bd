"""Training one assigned task on the board and uploading its result (paced when emulating a slower board).

A task that cannot run (an impossible spec, an unknown procedure, a procedure's bug) costs its round,
never the agent; running out of memory lowers what the board says training may use and registers it
again, so the server plans a smaller submodel from the next round on.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from nestling.edge.agent_jobs import TrainJob
from nestling.edge.agent_presence import AgentPresence
from nestling.edge.agent_profiling import AgentProfiling
from nestling.edge.agent_state_file import AgentStateFile
from nestling.edge.emulated_availability import TaskInterruption
from nestling.edge.emulation import EmulationTarget, TaskPacer
from nestling.edge.procedures import ClientData, DeviceStore
from nestling.edge.result_uploads import ResultUploads
from nestling.edge.trainer import run_task
from nestling.errors import NestlingError
from nestling.messages import Result, Task
from nestling.wire.fleet_messages import encode_result

log = logging.getLogger("nestling.agent")


class AgentTraining:
    """Runs tasks on the worker thread; `current` is the (task id, session) being trained now."""

    def __init__(
        self,
        data: ClientData,
        torch_device: str,
        store: DeviceStore,
        state_file: AgentStateFile,
        presence: AgentPresence,
        profiling: AgentProfiling,
        uploads: ResultUploads,
        emulation: EmulationTarget | None,
        stopping: threading.Event,
        interruption: TaskInterruption | None = None,
    ) -> None:
        self.data = data
        self.torch_device = torch_device
        self.store = store  # the procedures' per-device state, kept across rounds
        self.state_file = state_file
        self.presence = presence
        self.profiling = profiling
        self.uploads = uploads
        self.emulation = (
            emulation  # `nestling agent --emulate`: behave like a slower board (edge/emulation.py)
        )
        self.interruption = interruption  # an emulated board stops a task when it leaves or the round closes
        sleep = stopping.wait if interruption is None else interruption.sleep
        self.pacer = None if emulation is None else TaskPacer(emulation, tuple(data.x.shape[1:]), sleep=sleep)
        self.current: tuple[str, str] | None = None
        self.results_sent = 0

    def run(self, job: TrainJob) -> None:
        if self.interruption is None:
            self._run(job)
            return
        skip = self.interruption.begin(job.task.round, job.received, job.session)
        try:
            if skip is not None:
                log.info("round %d: %s not trained: %s", job.task.round, job.task.task_id, skip)
                return
            self._run(job)
        finally:
            self.interruption.end()

    def _abandoned(self, task: Task, when: str) -> bool:
        """True (and logged) when the emulated board must stop this task: it left, or the round closed."""
        if self.interruption is None or not self.interruption.interrupted:
            return False
        pacing = None if self.pacer is None else self.pacer.pacing.get(task.task_id)
        if pacing is not None and self.emulation is not None:  # what the host managed before it stopped
            log.info("%s", pacing.line(task.round, self.emulation.name))
        log.info(
            "round %d: abandoned %s %s: %s; no result is sent",
            task.round,
            task.task_id,
            when,
            self.interruption.reason,
        )
        return True

    def _run(self, job: TrainJob) -> None:
        task, session = job.task, job.session
        self.presence.state, self.presence.round = "training", task.round
        self.current = (task.task_id, session)
        self.presence.heartbeat()
        if self.pacer is not None:  # the emulated board is still downloading the task
            self.pacer.download(task, job.received)
            if self._abandoned(task, "while downloading"):
                self.presence.state, self.current = "online", None
                return
        started = time.monotonic()
        try:
            result = run_task(task, self.data, self.store, self.torch_device)
            if self.pacer is not None:  # the emulated board trains for longer
                self._pad_training(task, result, time.monotonic() - started)
        except NestlingError as exc:  # an impossible spec, an unknown procedure: the round goes on without us
            log.error("task %s refused: %s", task.task_id, exc)
            return
        except (torch.OutOfMemoryError, MemoryError) as exc:  # sized down, not dropped: tell the server
            self.profiling.lower_memory(task, exc)
            self.presence.hello()
            return
        except Exception:  # a procedure's bug: keep serving later rounds
            log.exception("task %s failed", task.task_id)
            return
        finally:
            self.presence.state, self.current = "online", None
        if self._abandoned(task, "while training"):
            return
        trained = time.monotonic()
        result.metrics["train_wall_s"] = trained - started  # what the board took (padded when emulating)
        self.state_file.save(self.store)
        payload = encode_result(result, session)
        frames = self.uploads.prepare(payload, task, session)
        if self.pacer is not None:  # the result leaves when the emulated board's upload would be done
            self._pace_upload(result, trained)
            if self._abandoned(task, "while uploading"):
                self.uploads.sent = None  # not kept for a resend either: it never left the board
                return
        self.uploads.send(frames)
        self.results_sent += 1
        memory = self.presence.monitor.memory.reading()
        log.info(
            "round %d: sent %s for submodel %s (%.2f MB, %.2fs training, loss %s, peak memory %.0f MiB)",
            task.round,
            task.task_id,
            result.spec_id,
            len(payload) / 1e6,
            result.metrics["train_seconds"],
            result.metrics.get("loss_mean"),
            memory.peak_rss_bytes / 2**20,
        )
        self.presence.heartbeat()

    def _pad_training(self, task: Task, result: Result, measured_s: float) -> None:
        assert self.pacer is not None and self.emulation is not None
        pacing = self.pacer.compute(task, len(self.data), measured_s)
        result.metrics.update(
            {
                "emulated": self.emulation.name,
                "emulated_down_s": pacing.down_s,
                "emulated_compute_s": pacing.compute_s,
                "emulation_overrun_s": pacing.overrun_s,
            }
        )

    def _pace_upload(self, result: Result, trained: float) -> None:
        assert self.pacer is not None and self.emulation is not None
        log.info("%s", self.pacer.upload(result, trained).line(result.round, self.emulation.name))


def warm_up() -> None:
    """Pay torch's one-time lazy imports (the optimiser pulls in torch._dynamo: seconds on a small board)
    while waiting for the first task, not inside the first round's deadline."""
    weight = torch.zeros(1, requires_grad=True)
    torch.optim.SGD([weight], lr=0.1).step()
