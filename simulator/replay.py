"""Trace replay: simulated devices get traces and a virtual clock; the one coordinator runs them unchanged.

Device i replays trace i; with more devices than traces the traces repeat, with more traces than data
partitions the partitions repeat (device i trains on partition i mod partitions). Each round's tasks
are written to timeline.jsonl (dispatch, end, outcome) for the report. Between rounds the virtual clock
moves by the server's own time as `[run] server_time` says (simulator/server_time.py).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from nestling.edge.procedures import ClientData
from nestling.messages import Result, Task
from nestling.profiler.traces import DeviceTrace
from nestling.server.clock import VirtualClock
from nestling.server.coordinator import RoundRecord
from nestling.server.strategies.base import DeviceInfo
from nestling.simulator.backend import Backend
from nestling.simulator.durations import Arrival, TraceDurations
from nestling.simulator.emulated_fleet import trace_profile
from nestling.simulator.fleetdata import client_provider, device_id, device_index
from nestling.simulator.inprocess import InProcessTransport, ResultObserver
from nestling.simulator.server_time import NoServerTime, ServerClock, ServerTime, TimedBackend
from nestling.simulator.transport_time import TransportTime
from nestling.spec import SubmodelSpec
from nestling.strict_json import strict_dumps

TIMELINE = "timeline.jsonl"


def fleet_size(clients: int, traces: int) -> int:
    """Every traced device takes part, and every configured client does (the shorter list repeats)."""
    return max(clients, traces)


def cycled_provider(partitions: int, **fleet_args: Any) -> Callable[[str], ClientData]:
    """Worker-side data factory: device i trains on partition i mod `partitions`."""
    data_for = client_provider(**fleet_args)

    def provide(device: str) -> ClientData:
        data: ClientData = data_for(device_id(device_index(device) % partitions))
        return data

    return provide


class TraceReplay:
    """The simulated fleet: which trace each device replays, when it is online, when its results arrive."""

    def __init__(
        self,
        devices: list[DeviceInfo],
        traces: list[DeviceTrace],
        input_shape: tuple[int, int, int],
        plan: tuple[SubmodelSpec, int] | None = None,
    ) -> None:
        """`plan` (the run's full model and batch size): each device also carries the profile an agent emulating
        its trace would send, so the strategy sizes it by memory and, with a deadline, by time."""
        if not traces:
            raise ValueError("a replay needs at least one device trace")
        self.traces = {d.device_id: traces[d.index % len(traces)] for d in devices}
        self.devices = [
            replace(
                d,
                board=None if plan is None else trace_profile(self.traces[d.device_id], *plan),
                memory_budget_bytes=self.traces[d.device_id].memory_budget_bytes,
                profile={
                    **(d.profile or {}),
                    "device_class": self.traces[d.device_id].device_class,
                    "trace": self.traces[d.device_id].device_id,
                },
            )
            for d in devices
        ]
        self.durations = TraceDurations(
            self.traces, {d.device_id: d.num_samples for d in devices}, input_shape
        )

    def online(self, device: DeviceInfo, t: float) -> DeviceInfo | None:
        """Online for more than an instant: a device at the closing instant of its window is leaving."""
        trace = self.traces[device.device_id]
        if not trace.available_until(t) > t:
            return None
        budget = trace.budget_at(t)
        return device if budget == device.memory_budget_bytes else replace(device, memory_budget_bytes=budget)

    def next_online(self, device: DeviceInfo, t: float) -> float:
        """Start of the next stretch online for more than an instant (inf if none)."""
        trace = self.traces[device.device_id]
        start = trace.next_available(t)
        for _ in range(2 * len(trace.availability) + 2):  # skip zero-length windows and closing instants
            if not math.isfinite(start) or trace.available_until(start) > start:
                return start
            start = trace.next_available(math.nextafter(start, math.inf))
        return math.inf

    def arrival(self, task: Task, t: float) -> Arrival:
        return self.durations.arrival(task, t)

    def trace_of(self, device: str) -> DeviceTrace:
        return self.traces[device]

    def device_class(self, device: str) -> str:
        return self.traces[device].device_class


class Replay:
    """A replay wired for one run: fleet, virtual clock, transport, and the timeline file it keeps."""

    def __init__(
        self,
        trace_path: str | Path,
        traces: list[DeviceTrace],
        devices: list[DeviceInfo],
        backend: Backend,
        input_shape: tuple[int, int, int],
        out_dir: Path,
        plan: tuple[SubmodelSpec, int] | None = None,
        *,
        server_time: ServerTime | None = None,
        transport_time: TransportTime | None = None,
        schedule: tuple[int, int] = (1, 1),
        observers: Sequence[ResultObserver] = (),
        tamper: Callable[[Task, Result], Result | None] | None = None,
    ) -> None:
        """`server_time`: how far the clock moves for the server's work after each round (none by default);
        `transport_time`: what the server and broker add to each task inside a round (none by default);
        `schedule`: the run's rounds and checkpoint_every, which say the rounds that write a checkpoint;
        `observers` and `tamper` as InProcessTransport takes them."""
        self.trace_path = str(trace_path)
        self.fleet = TraceReplay(devices, traces, input_shape, plan)
        self.clock = VirtualClock()
        timed = TimedBackend(backend)
        self.transport = InProcessTransport(
            self.fleet.devices,
            timed,
            self.clock,
            self.fleet,
            tamper=tamper,
            observers=observers,
            transport_time=transport_time,
        )
        self.server = ServerClock(server_time or NoServerTime(), self.clock, timed, out_dir, *schedule)
        self.timeline = out_dir / TIMELINE

    def start(self, resume_round: int | None, last_virtual_time: float) -> None:
        """Fresh run: empty timeline. Resumed: clock at the last kept round's end plus the server time that
        followed it, later rounds dropped."""
        after_last = self.server.start(resume_round)
        if resume_round is None:
            self.timeline.unlink(missing_ok=True)
            return
        self.clock.advance_to(last_virtual_time + after_last)
        if self.timeline.exists():
            kept = [
                line
                for line in self.timeline.read_text().splitlines()
                if line.strip() and json.loads(line)["round"] < resume_round
            ]
            self.timeline.write_text("".join(line + "\n" for line in kept))

    def after_round(self, on_round: Callable[[RoundRecord], None] | None) -> Callable[[RoundRecord], None]:
        """A round hook that moves the clock by the server's time for the round, appends the round's task
        events to the timeline, then calls `on_round`."""

        def hook(record: RoundRecord) -> None:
            self.server.after_round(record)
            events = self.transport.drain_events()
            with self.timeline.open("a") as stream:
                for event in events:
                    trace = self.fleet.trace_of(event.device_id)  # the id the trace file gave this board
                    row = {
                        **asdict(event),
                        "device_class": trace.device_class,
                        "trace_device": trace.device_id,
                    }
                    stream.write(strict_dumps(row) + "\n")
            if on_round is not None:
                on_round(record)
            self.server.restart_timing()

        return hook

    def summary(self) -> dict[str, Any]:
        """Replay figures for summary.json: fleet, classes, and what became of the tasks."""
        rows = read_timeline(self.timeline.parent)
        outcomes = Counter(row["outcome"] for row in rows)
        classes = Counter(self.fleet.device_class(d.device_id) for d in self.fleet.devices)
        transport = self.transport.transport_time
        return {
            **({"transport_time": asdict(transport)} if transport.mode != "none" else {}),
            "traces": self.trace_path,
            "devices": len(self.fleet.devices),
            "device_classes": dict(classes),
            "tasks": len(rows),
            "outcomes": dict(outcomes),
            "server_time": self.server.summary(),
        }


def read_timeline(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / TIMELINE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
