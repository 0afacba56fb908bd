"""The edge agent: registers with the fleet, trains each assigned slice, reports, heartbeats, recovers by itself.

Three threads: paho's network thread (only queues messages), a control thread (tasks in, chunk
re-requests both ways, hellos, heartbeats) and a worker thread (training, and the end-of-run export of
the board's own deployable). Training never blocks heartbeats or answers to re-requests, and only the
newest task is trained when several queue up.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import torch

from nestling.edge.agent_config import AgentConfig, state_dir
from nestling.edge.emulation import EmulationTarget, TaskPacer
from nestling.edge.monitor import ResourceMonitor
from nestling.edge.procedures import ClientData, DeviceStore
from nestling.edge.self_profile import CACHE_NAME, ProfileInputs, board_profile
from nestling.edge.store_state import load_store_file, save_store_file
from nestling.edge.trainer import run_task
from nestling.errors import NestlingError, WireError
from nestling.messages import Result, Task
from nestling.profiler.board_profile import BoardProfile
from nestling.profiler.estimator import estimate
from nestling.spec import SubmodelSpec
from nestling.wire.codec import CHUNK_KIND, CHUNK_REQUEST_KIND, decode_message, read_header
from nestling.wire.export_messages import EXPORT, ExportOrder, decode_export_order, encode_export_report
from nestling.wire.fleet_messages import (
    REHELLO,
    DeviceStatus,
    decode_server_status,
    decode_task,
    encode_hello,
    encode_result,
    encode_status,
)
from nestling.wire.topics import OFFLINE, QOS, FleetTopics
from nestling.wire.transfers import Inbound, Outbound

log = logging.getLogger("nestling.agent")


@dataclass(frozen=True)
class SentResult:
    task_id: str
    round: int
    session: str
    frames: list[bytes]


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
        self.topics = FleetTopics(config.broker.fleet)
        self.monitor = monitor or ResourceMonitor(config.device.torch_device)
        # The procedures' per-device state, kept across rounds (and restarts, with [device] state_file).
        self.state_file = Path(config.device.state_file) if config.device.state_file else None
        self.store = (
            load_store_file(self.state_file, self._store_owner()) if self.state_file else DeviceStore()
        )
        self.server_session: str | None = None
        self.results_sent = 0
        self.state: str = "online"
        self.round: int | None = None
        limits = config.agent
        self.outbound = Outbound(limits.chunk_kb * 1024, max_transfers=4)
        self.inbound = Inbound(limits.max_message_mb * 1024 * 1024, stall_s=limits.stall_s)
        self._inbox: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
        self._slot: tuple[Task, str] | None = None  # the newest task not yet started, and its server session
        self._training: tuple[str, str] | None = None  # (task id, session) being trained now
        self._sent: SentResult | None = None  # the last result, kept to resend after an outage
        self._export_slot: tuple[ExportOrder, str] | None = None  # an end-of-run export order not yet started
        self._export_seen: tuple[str, str] | None = None  # (order id, session) of the order taken last
        self._export_report: bytes | None = None  # its report, resent if the server repeats the order
        self._slot_ready = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # `nestling agent --emulate`: behave like a slower board (edge/emulation.py; the CLI resolves the board)
        self.emulation = emulation
        self.pacer = (
            None
            if emulation is None
            else TaskPacer(emulation, tuple(data.x.shape[1:]), sleep=self._stop.wait)
        )
        # The measured profile of the fleet's model (edge/self_profile.py), the key it was made for, whether a
        # measurement is under way (the server waits for it), and a memory ceiling an out-of-memory lowered.
        self.board: BoardProfile | None = None
        self._profile_key: str | None = None
        self._profiling = bool(config.device.profile)
        self._memory_cap: int | None = None
        self._chunks_from: dict[str, float] = {}  # task transfer id → when its first chunk arrived
        self._task_received: dict[str, float] = {}  # queued task id → when its first frame arrived
        self.client = config.broker.client(
            f"nestling-{self.topics.fleet}-{self.device_id}",
            will=(self.topics.status(self.device_id), OFFLINE, True),
        )
        self.client.max_inflight_messages_set(64)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = lambda _c, _u, msg: self._inbox.put((msg.topic, bytes(msg.payload)))

    # -- what the server learns about this board -------------------------------------------------
    def profile(self) -> dict[str, Any]:
        device, data = self.config.device, self.config.data
        profile: dict[str, Any] = {
            "num_samples": len(self.data),
            "labels": sorted(set(self.data.y.tolist())),
            "index": data.client_index,
            "dataset": data.dataset,
            **self.monitor.profile(),
        }
        if device.tier is not None:  # pinned: strategies size by budget first, so the budget stays home
            profile["tier"] = device.tier
        elif device.memory_budget_mb is not None:  # a hand-set budget wins over what the board measured
            budget = int(device.memory_budget_mb * 1024 * 1024)
            profile["memory_budget_bytes"] = (
                budget if self._memory_cap is None else min(budget, self._memory_cap)
            )
        if device.profile:
            profile["profiling"] = self._profiling
        if self.board is not None:
            board = self.board.to_dict()
            if self._memory_cap is not None:
                board["memory_bytes"] = min(board["memory_bytes"], self._memory_cap)
            profile["board_profile"] = board
        export = self.config.export.advertised()
        if export is not None:  # asks the server for the final model of its submodel when the run ends
            profile["export"] = export
        if self.emulation is not None:  # the server logs it and lists it in summary.json
            profile["emulating"] = self.emulation.describe()
        return profile

    def _say_hello(self) -> None:
        self.client.publish(
            self.topics.hello(self.device_id), encode_hello(self.device_id, self.profile()), qos=QOS
        )
        self._heartbeat()

    def _heartbeat(self) -> None:
        status = DeviceStatus(self.device_id, self.state, self.round, self.monitor.snapshot())
        self.client.publish(self.topics.status(self.device_id), encode_status(status), qos=QOS, retain=True)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> Agent:
        host, port = self.config.broker.host_port
        self.client.connect_async(host, port, keepalive=15)
        self.client.loop_start()  # retries the first connection too: the broker may come up later
        for target, name in ((self._control, "control"), (self._work, "worker")):
            thread = threading.Thread(target=target, name=f"agent-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Leave cleanly: mark this device offline (as the last will would) and disconnect."""
        self._stop.set()
        with self._slot_ready:
            self._slot_ready.notify_all()
        for thread in self._threads:
            thread.join(5.0)
        if self.client.is_connected():
            self.client.publish(
                self.topics.status(self.device_id), OFFLINE, qos=QOS, retain=True
            ).wait_for_publish(2.0)
        self.client.disconnect()
        self.client.loop_stop()

    def request_stop(self) -> None:
        """Ask the agent to stop (safe from a signal handler); `wait()` then returns."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped (True) or `timeout` passed (False)."""
        return self._stop.wait(timeout)

    def _on_connect(
        self, client: mqtt.Client, userdata: object, flags: object, reason: object, properties: object
    ) -> None:
        if getattr(reason, "is_failure", False):
            log.error("broker refused %s: %s", self.device_id, reason)
            return
        client.subscribe(
            [
                (self.topics.task(self.device_id), QOS),
                (self.topics.ctrl(self.device_id), QOS),
                (self.topics.server_status, QOS),
            ]
        )
        self._say_hello()  # after every (re)connect: a restarted broker or server has forgotten us
        log.info("%s connected and registered", self.device_id)

    def _on_disconnect(self, *args: object) -> None:
        if not self._stop.is_set():
            log.warning("lost the broker; paho reconnects by itself")

    # -- control thread --------------------------------------------------------------------------
    def _control(self) -> None:
        next_beat = time.monotonic() + self.config.agent.heartbeat_s
        while not self._stop.is_set():
            try:
                topic, payload = self._inbox.get(timeout=0.2)
                self._handle(topic, payload)
            except queue.Empty:
                pass
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.config.agent.heartbeat_s
                self._heartbeat()
            for request in self.inbound.requests():
                self.client.publish(self.topics.result(self.device_id), request, qos=QOS)
            for transfer_id in self.inbound.expired():
                log.warning("gave up on task transfer %s: chunks missing", transfer_id)

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
        greet = self._profile_for(status.plan)
        if status.session != self.server_session:  # a server process we have not greeted yet
            self.server_session = status.session
            log.info("new server session %s: registering again", status.session)
            greet = True
        if greet:
            self._say_hello()
        sent = self._sent
        if (
            sent
            and status.phase == "training"
            and (sent.round, sent.session) == (status.round, status.session)
        ):
            self._resend(sent)  # the server re-announced the round we answered: our result may have been lost

    def _profile_for(self, plan: dict[str, Any] | None) -> bool:
        """Have a profile of the model the server announced: the cached one, else measure it (in the
        background; the hello says `profiling` meanwhile, so the server does not count this board yet).
        True when the server must hear a new hello."""
        device = self.config.device
        if not device.profile:
            return False
        if plan is None:  # the server plans nothing from profiles: do not keep it waiting
            was, self._profiling = self._profiling, False
            return was
        emulate = (
            None
            if self.emulation is None
            else self.emulation.name
            + (f"/{self.emulation.trace_device}" if self.emulation.trace_device else "")
        )
        inputs = ProfileInputs(
            plan["spec"], plan["batch"], device.torch_device, device.profile_margin, emulate
        )
        key = inputs.key()
        if key == self._profile_key:
            return False
        self._profile_key, self._profiling = key, True
        threading.Thread(target=self._measure, args=(inputs,), name="agent-profile", daemon=True).start()
        return True

    def _measure(self, inputs: ProfileInputs) -> None:
        cache = state_dir(self.config) / CACHE_NAME
        try:
            board, fresh = board_profile(
                inputs, cache, self.emulation, repeats=self.config.device.profile_repeats
            )
            self.board = board
            log.info(
                "%s profile of %s at batch %d (%s): %.0f MB for training, %.1f GFLOP/s, step %.1f ms",
                "measured" if fresh else "cached",
                board.arch,
                board.batch,
                board.source,
                board.memory_bytes / 1e6,
                board.gflops,
                board.step_s * 1000,
            )
        except Exception:  # a profile the board cannot make: the server sizes it as before
            log.exception("could not profile the fleet's model")
        self._profiling = False
        self._say_hello()

    def _resend(self, sent: SentResult) -> None:
        """Publish a result again (after a broker outage); the server applies a result once, whatever arrives."""
        log.info("re-sending the result of %s", sent.task_id)
        for frame in sent.frames:
            self.client.publish(self.topics.result(self.device_id), frame, qos=QOS)

    def _on_ctrl(self, payload: bytes) -> None:
        kind = read_header(payload)["kind"]
        if kind == CHUNK_REQUEST_KIND:
            for frame in self.outbound.answer(payload, "server"):
                self.client.publish(self.topics.result(self.device_id), frame, qos=QOS)
        elif kind == REHELLO:
            self._say_hello()
        elif kind in (CHUNK_KIND, EXPORT):
            self._on_export_frame(payload)
        else:
            raise WireError(f"unexpected control message {kind!r}")

    def _on_export_frame(self, payload: bytes) -> None:
        """The end-of-run export order (chunked like a task): queue it for the worker, answer a repeat."""
        if read_header(payload)["kind"] == CHUNK_KIND:
            whole = self.inbound.add(payload)
            if whole is None:
                return
            payload = whole
        order, session = decode_export_order(
            decode_message(payload, max_bytes=self.inbound.max_payload_bytes)
        )
        if order.device_id != self.device_id:
            raise WireError(f"export order {order.order_id} is for {order.device_id}, not {self.device_id}")
        if (order.order_id, session) == self._export_seen:
            if self._export_report is not None:  # the server lost our report, not us the order
                self.client.publish(self.topics.result(self.device_id), self._export_report, qos=QOS)
            return
        with self._slot_ready:
            self._export_seen, self._export_report = (order.order_id, session), None
            self._export_slot = (order, session)
            self._slot_ready.notify()

    def _on_task_frame(self, payload: bytes) -> None:
        header, received = read_header(payload), time.monotonic()
        if header["kind"] == CHUNK_KIND:
            if len(self._chunks_from) > 16:  # transfers given up on never complete: forget them
                self._chunks_from.clear()
            received = self._chunks_from.setdefault(
                header["transfer_id"], received
            )  # the download began here
            whole = self.inbound.add(payload)
            if whole is None:
                return
            self._chunks_from.pop(header["transfer_id"], None)
            payload = whole
        task, session = decode_task(decode_message(payload, max_bytes=self.inbound.max_payload_bytes))
        if task.device_id != self.device_id:
            raise WireError(f"task {task.task_id} is for {task.device_id}, not {self.device_id}")
        sent = self._sent
        if sent and (sent.task_id, sent.session) == (task.task_id, session):
            self._resend(sent)  # the server sent the task again: it lost our answer, not us the task
            return
        if (task.task_id, session) == self._training:
            return
        with self._slot_ready:
            if self._slot is None or task.round >= self._slot[0].round or session != self._slot[1]:
                self._slot = (task, session)  # an older queued task is superseded: its round has closed
                self._task_received = {task.task_id: received}
            self._slot_ready.notify()

    # -- worker thread ---------------------------------------------------------------------------
    def _work(self) -> None:
        warm_up()
        while not self._stop.is_set():
            with self._slot_ready:
                while self._slot is None and self._export_slot is None and not self._stop.is_set():
                    self._slot_ready.wait(0.5)
                if self._stop.is_set():
                    return
                export, self._export_slot = self._export_slot, None
                if export is None:
                    task, session = self._slot  # type: ignore[misc]
                    self._slot = None
            if export is not None:  # the run is over: a task still queued is stale, the export comes first
                self._export_and_report(*export)
                continue
            self._train_and_report(task, session)

    def _train_and_report(self, task: Task, session: str) -> None:
        self.state, self.round, self._training = "training", task.round, (task.task_id, session)
        self._heartbeat()
        if self.pacer is not None:  # the emulated board is still downloading the task
            self.pacer.download(task, self._task_received.pop(task.task_id, time.monotonic()))
        started = time.monotonic()
        try:
            result = run_task(task, self.data, self.store, self.config.device.torch_device)
            if self.pacer is not None:  # the emulated board trains for longer
                self._pad_training(task, result, time.monotonic() - started)
        except NestlingError as exc:  # an impossible spec, an unknown procedure: the round goes on without us
            log.error("task %s refused: %s", task.task_id, exc)
            return
        except (torch.OutOfMemoryError, MemoryError) as exc:  # sized down, not dropped: tell the server
            self._memory_pressure(task, exc)
            return
        except Exception:  # out of memory, a procedure's bug: keep serving later rounds
            log.exception("task %s failed", task.task_id)
            return
        finally:
            self.state, self._training = "online", None
        trained = time.monotonic()
        result.metrics["train_wall_s"] = trained - started  # what the board took (padded when emulating)
        self._save_store()
        payload = encode_result(result, session)
        frames = self.outbound.frames(payload, "server")
        self._sent = SentResult(task.task_id, task.round, session, frames)
        if self.pacer is not None:  # the result leaves when the emulated board's upload would be done
            self._pace_upload(result, trained)
        for frame in frames:
            self.client.publish(self.topics.result(self.device_id), frame, qos=QOS)
        self.results_sent += 1
        log.info(
            "round %d: sent %s for submodel %s (%.2f MB, %.2fs training, loss %s)",
            task.round,
            task.task_id,
            result.spec_id,
            len(payload) / 1e6,
            result.metrics["train_seconds"],
            result.metrics.get("loss_mean"),
        )
        self._heartbeat()

    def _memory_pressure(self, task: Task, exc: BaseException) -> None:
        """An out-of-memory failure: cap what this board says training may use below the submodel that
        failed, and say hello again, so the server plans a smaller one from the next round on."""
        spec = SubmodelSpec.from_dict(task.spec)
        batch = int(task.hparams.get("batch_size", self.board.batch if self.board else 32))
        needed = estimate(spec, batch).training_bytes
        cap = int(needed * 0.9)
        self._memory_cap = cap if self._memory_cap is None else min(cap, self._memory_cap)
        log.error(
            "task %s ran out of memory (%s): telling the server to plan under %.1f MB",
            task.task_id,
            type(exc).__name__,
            self._memory_cap / 1e6,
        )
        self._say_hello()

    def _store_owner(self) -> str:
        return f"{self.config.broker.fleet}/{self.device_id}"

    def _save_store(self) -> None:
        """Persist the store after each task; a full disk costs the state, never the result."""
        if self.state_file is None or not self.store:
            return
        try:
            save_store_file(self.state_file, self.store, self._store_owner())
        except OSError as exc:
            log.error("could not save device state to %s: %s", self.state_file, exc)

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

    def _export_and_report(self, order: ExportOrder, session: str) -> None:
        """Build this board's deployable from the final weights (edge/board_export.py), then report it.
        Runs on the worker thread: heartbeats go on (state "exporting") while ONNX / TensorRT build."""
        from nestling.edge.board_export import (
            export_on_board,  # onnx / onnxruntime load only on a board that exports
        )

        self.state = "exporting"
        self._heartbeat()
        try:
            report = export_on_board(
                order,
                self.config.export,
                fleet=self.topics.fleet,
                device_id=self.device_id,
                data=self.config.data,
                threads=self.config.device.threads,
            )
        finally:
            self.state = "online"
        try:
            payload = encode_export_report(report, session)
        except WireError as exc:  # e.g. a bundle path too long for the report: still answer, as a failure
            report = replace(report, status="failed", bundle=None, models=[], files={}, error=str(exc))
            payload = encode_export_report(report, session)
        self._export_report = payload
        self.client.publish(self.topics.result(self.device_id), payload, qos=QOS)
        log.info(
            "export of %s (%s): %s %s",
            order.name,
            report.spec_id,
            report.status,
            report.bundle or report.error,
        )
        self._heartbeat()


def warm_up() -> None:
    """Pay torch's one-time lazy imports (the optimiser pulls in torch._dynamo: seconds on a small board)
    while waiting for the first task, not inside the first round's deadline."""
    weight = torch.zeros(1, requires_grad=True)
    torch.optim.SGD([weight], lr=0.1).step()
