"""The edge agent: registers with the fleet, trains each assigned slice, reports, heartbeats, recovers by itself.

Three threads: paho's network thread (only queues messages), a control thread (tasks in, chunk
re-requests both ways, hellos, heartbeats) and a worker thread (training, and the end-of-run export of
the board's own deployable). Training never blocks heartbeats or answers to re-requests, and only the
newest task is trained when several queue up.

`Agent` wires one object per job and routes messages between them: the connection (agent_link.py),
what the server learns of the board (agent_presence.py, agent_profiling.py), downloads and their chunks
(agent_downloads.py), the worker's queue (agent_jobs.py), training (agent_training.py), result uploads
(result_uploads.py), the end-of-run export (agent_exports.py) and the state file (agent_state_file.py).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from nestling.edge.agent_config import AgentConfig
from nestling.edge.agent_downloads import AgentDownloads
from nestling.edge.agent_exports import AgentExports
from nestling.edge.agent_jobs import AgentJobs, ExportJob, TrainJob
from nestling.edge.agent_link import AgentLink
from nestling.edge.agent_presence import AgentPresence
from nestling.edge.agent_profiling import AgentProfiling
from nestling.edge.agent_state_file import AgentStateFile
from nestling.edge.agent_training import AgentTraining, warm_up
from nestling.edge.emulated_availability import CLOSED_PHASES, EmulatedAvailability, TaskInterruption
from nestling.edge.emulation import EmulationTarget
from nestling.edge.monitor import ResourceMonitor
from nestling.edge.procedures import ClientData
from nestling.edge.result_uploads import ResultUploads
from nestling.errors import NestlingError, WireError
from nestling.wire.codec import CHUNK_KIND, CHUNK_REQUEST_KIND, read_header
from nestling.wire.export_messages import EXPORT
from nestling.wire.fleet_messages import REHELLO, decode_server_status
from nestling.wire.topics import OFFLINE

log = logging.getLogger("nestling.agent")
FIRST_NOTICE_S = 5.0  # an agent that found no broker or server by then says what it is waiting for ...
NOTICE_EVERY_S = 30.0  # ... and repeats it this often while it waits


class Agent:
    """One board in a fleet. `start()` returns at once; the agent keeps (re)connecting on its own."""

    def __init__(
        self,
        config: AgentConfig,
        data: ClientData,
        monitor: ResourceMonitor | None = None,
        emulation: EmulationTarget | None = None,
    ) -> None:
        self.config = config
        self.data = data
        self.device_id = config.device.id
        self.emulation = emulation  # `nestling agent --emulate`: the CLI resolves the board class
        self.monitor = monitor or ResourceMonitor(config.device.torch_device)
        self.server_session: str | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        limits = config.agent
        # The procedures' per-device state, kept across rounds (and restarts, with [device] state_file).
        state_path = Path(config.device.state_file) if config.device.state_file else None
        self.state_file = AgentStateFile(state_path, config.broker.fleet, self.device_id)
        self.store = self.state_file.load()
        self.link = AgentLink(config.broker, self.device_id, self._stop, on_connected=self._say_hello)
        self.topics = self.link.topics
        self.profiling = AgentProfiling(config, emulation, on_measured=self._say_hello)
        self.presence = AgentPresence(self.link, config, data, self.monitor, self.profiling, emulation)
        self.uploads = ResultUploads(self.link, limits.chunk_kb * 1024)
        self.downloads = AgentDownloads(self.link, limits.max_message_mb * 1024 * 1024, limits.stall_s)
        self.jobs = AgentJobs(self._stop)
        # An emulated board stops a task when it leaves or the task's round closes (edge/emulated_availability.py).
        self.interruption = None if emulation is None else TaskInterruption(self._stop)
        self.availability = (
            None
            if emulation is None or emulation.availability is None or self.interruption is None
            else EmulatedAvailability(emulation.availability, self.link, self.interruption, self._stop)
        )
        self.training = AgentTraining(
            data,
            config.device.torch_device,
            self.store,
            self.state_file,
            self.presence,
            self.profiling,
            self.uploads,
            emulation,
            self._stop,
            self.interruption,
        )
        self.exports = AgentExports(self.link, self.presence, config)

    @property
    def state(self) -> str:
        """ "online", "training" or "exporting": what the heartbeats say."""
        return self.presence.state

    def _say_hello(self) -> None:
        self.presence.hello()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> Agent:
        # torch's lazy imports (seconds on a small or busy board) are paid before the board says hello, so no
        # task waits behind them: an emulated board's download would otherwise count them as its own time.
        warm_up()
        self.link.start()
        for target, name in ((self._control, "control"), (self._work, "worker")):
            thread = threading.Thread(target=target, name=f"agent-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Leave cleanly: mark this device offline (as the last will would) and disconnect."""
        self._stop.set()
        self.jobs.wake()
        for thread in self._threads:
            thread.join(5.0)
        self.link.leave()

    def request_stop(self) -> None:
        """Ask the agent to stop (safe from a signal handler); `wait()` then returns."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped (True) or `timeout` passed (False)."""
        return self._stop.wait(timeout)

    # -- control thread --------------------------------------------------------------------------
    def _control(self) -> None:
        next_beat = time.monotonic() + self.config.agent.heartbeat_s
        next_notice = time.monotonic() + FIRST_NOTICE_S
        while not self._stop.is_set():
            message = self.link.next_message(0.2)
            if message is not None:
                self._handle(*message)
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.config.agent.heartbeat_s
                self.presence.heartbeat()
            if time.monotonic() >= next_notice:
                next_notice = time.monotonic() + NOTICE_EVERY_S
                self._say_what_it_waits_for()
            self.downloads.tick()

    def _say_what_it_waits_for(self) -> None:
        """An agent with no broker or no server says so (INFO), rather than waiting in silence."""
        if not self.link.connected.is_set():
            log.info(
                "waiting for the MQTT broker at %s (still retrying; is it running and reachable?)",
                self.config.broker.url,
            )
        elif self.server_session is None:
            log.info(
                "connected to the broker; waiting for the server of fleet '%s' (no status on %s yet)",
                self.topics.fleet,
                self.topics.server_status,
            )

    def _handle(self, topic: str, payload: bytes) -> None:
        try:
            if topic == self.topics.server_status:
                self._on_server_status(payload)
            elif topic == self.topics.task(self.device_id):
                self._on_task_frame(payload)
            elif topic == self.topics.ctrl(self.device_id):
                self._on_ctrl(payload)
        except NestlingError as exc:
            log.warning("ignored a message on %s: %s", topic, exc)
        except Exception:  # the control thread must outlive any message; the traceback shows the bug
            log.exception("failed to handle a message on %s", topic)

    def _on_server_status(self, payload: bytes) -> None:
        if bytes(payload) == OFFLINE:
            log.warning("the server went offline; waiting for it to come back")
            return
        status = decode_server_status(payload)
        if self.availability is not None:
            self.availability.on_announcement(status.phase)
        if self.interruption is not None and status.phase in CLOSED_PHASES and status.round is not None:
            self.interruption.round_closed(status.round, status.session)
        greet = self.profiling.for_plan(status.plan)
        if status.session != self.server_session:  # a server process we have not greeted yet
            self.server_session = status.session
            log.info(
                "the server of fleet '%s' is up (session %s, %s): sending it this board's hello",
                self.topics.fleet,
                status.session,
                status.phase,
            )
            greet = True
        if greet:
            self._say_hello()
        if (
            status.phase == "training"
        ):  # the server re-announced the round we answered: our result may be lost
            self.uploads.resend_for_round(status.round, status.session)

    def _on_ctrl(self, payload: bytes) -> None:
        kind = read_header(payload)["kind"]
        if kind == CHUNK_REQUEST_KIND:
            self.uploads.answer(payload)
        elif kind == REHELLO:
            self._say_hello()
        elif kind in (CHUNK_KIND, EXPORT):  # the end-of-run export order, chunked like a task
            whole = self.downloads.export_order(payload)
            if whole is not None and not self.exports.is_repeat(*whole):
                self.jobs.offer_export(ExportJob(*whole))
        else:
            raise WireError(f"unexpected control message {kind!r}")

    def _on_task_frame(self, payload: bytes) -> None:
        whole = self.downloads.task(payload)
        if whole is None:
            return
        task, session, received = whole
        if self.uploads.resend_for_task(task.task_id, session):
            return  # the server sent the task again: it lost our answer, not we the task
        if (task.task_id, session) == self.training.current:
            return
        self.jobs.offer_task(TrainJob(task, session, received))

    # -- worker thread ---------------------------------------------------------------------------
    def _work(self) -> None:
        while (job := self.jobs.take()) is not None:
            if isinstance(
                job, ExportJob
            ):  # the run is over: a task still queued is stale, the export comes first
                self.exports.run(job.order, job.session)
            else:
                self.training.run(job)
