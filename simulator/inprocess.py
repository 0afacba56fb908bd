"""In-process transport: tasks go to a Backend; in a replay, results arrive at predicted virtual times."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from nestling.messages import Result, Task
from nestling.server.clock import VirtualClock
from nestling.server.strategies.base import DeviceInfo
from nestling.server.transport import Delivery
from nestling.simulator.backend import Backend
from nestling.simulator.durations import Arrival
from nestling.simulator.transport_time import TransportTime

# Sees every result a simulated board trained, with its task, before anything can alter it (a `tamper`): what a
# board computed is metered this way (simulator/reproduce_compute.py).
ResultObserver = Callable[[Task, Result], None]


class SimulatedFleet(Protocol):
    """What a replay knows about its devices over virtual time (simulator.replay.TraceReplay)."""

    def online(self, device: DeviceInfo, t: float) -> DeviceInfo | None:
        """The device as the server sees it at t (current memory budget), or None while it is offline."""
        ...

    def next_online(self, device: DeviceInfo, t: float) -> float:
        """Earliest time >= t the device is online (inf if never again)."""
        ...

    def arrival(self, task: Task, t: float) -> Arrival:
        """When the result of a task dispatched at t arrives, or when its device drops out."""
        ...


@dataclass
class TaskEvent:
    """One dispatched task as the replay saw it; `outcome` is used, dropped or cancelled (never trained)."""

    round: int
    device_id: str
    spec_id: str
    dispatched_at: float
    ends_at: float
    outcome: str = "pending"
    down_s: float = 0.0  # planned phases (download and upload include one latency each)
    compute_s: float = 0.0
    up_s: float = 0.0
    reach_s: float = 0.0  # the fleet transport's time until the board has its task's first chunk ...
    return_s: float = 0.0  # ... and from the board sending its result to the server holding it


class InProcessTransport:
    """Delivers tasks to simulated devices without a network.

    Without a fleet every result arrives as soon as it is trained (wall-clock runs). With one (trace
    replay on a virtual clock), results arrive at predicted virtual times, devices that go offline are
    reported when they do, and only the results the coordinator will use are actually trained."""

    def __init__(
        self,
        devices: list[DeviceInfo],
        backend: Backend,
        clock: VirtualClock | None = None,
        fleet: SimulatedFleet | None = None,
        tamper: Callable[[Task, Result], Result | None] | None = None,
        observers: Sequence[ResultObserver] = (),
        transport_time: TransportTime | None = None,
    ) -> None:
        """`transport_time` (replays only): what the server and broker add to each task of a round."""
        if fleet is not None and clock is None:
            raise ValueError("a simulated fleet needs the virtual clock it runs on")
        self._devices = devices
        self.backend = backend
        self.clock = clock
        self.fleet = fleet
        self.tamper = tamper  # robustness experiments: what a bad board would send instead of its result
        self.observers = tuple(
            observers
        )  # read-only: they see each trained result, never change what arrives
        self.transport_time = transport_time or TransportTime()
        self.pending: list[tuple[float, TaskEvent, Task | None]] = []  # None: a dropout event
        self.events: list[TaskEvent] = []  # every task dispatched in a replay; drained per round

    def devices(self) -> list[DeviceInfo]:
        if self.fleet is None or self.clock is None:
            return list(self._devices)
        online = self._online(self.clock.now())
        if not online:
            # A real server idles until someone checks in; in virtual time that is a jump.
            now = self.clock.now()
            soonest = min((self.fleet.next_online(d, now) for d in self._devices), default=float("inf"))
            if soonest != float("inf"):
                self.clock.advance_to(soonest)
                online = self._online(soonest)
        return online

    def _online(self, t: float) -> list[DeviceInfo]:
        assert self.fleet is not None
        seen = (self.fleet.online(d, t) for d in self._devices)
        return [d for d in seen if d is not None]

    def dispatch(self, tasks: list[Task]) -> None:
        now = self.clock.now() if self.clock is not None else 0.0
        transport = self.transport_time if self.fleet is not None else TransportTime()
        for task, lead in zip(tasks, transport.reach_s(tasks), strict=True):
            # The board's availability is read when its task reaches it; a dropout is noticed a hop later.
            arrival = self.fleet.arrival(task, now + lead) if self.fleet is not None else Arrival(0.0)
            back = transport.hop_s if arrival.dropped else transport.return_s(task)
            event = TaskEvent(
                task.round, task.device_id, task.spec_id, now, now + lead + arrival.seconds + back
            )
            event.reach_s, event.return_s = lead, back
            if arrival.cost is not None:
                event.down_s, event.compute_s, event.up_s = (
                    arrival.cost.down_s,
                    arrival.cost.compute_s,
                    arrival.cost.up_s,
                )
            if self.fleet is not None:
                self.events.append(event)
            self.pending.append((event.ends_at, event, None if arrival.dropped else task))
        self.pending.sort(key=lambda item: (item[0], item[1].device_id))

    def wait(self, deadline: float, want: int) -> Delivery:
        """Take events in time order up to `deadline` until `want` results are due; train only those."""
        delivery = Delivery()
        due: list[tuple[float, TaskEvent, Task]] = []
        last = None
        taken = 0
        for at, event, task in self.pending:
            if at > deadline or len(due) >= max(0, want):
                break
            taken += 1
            last = at
            if task is None:
                event.outcome = "dropped"
                delivery.dropped.append(event.device_id)
            else:
                event.outcome = "used"
                due.append((at, event, task))
        self.pending = self.pending[taken:]
        if due:
            delivery.results = self.backend.run([task for _, _, task in due])
            if self.fleet is not None:  # the board's training time is the replay's, not this host's
                planned = {task.task_id: event.compute_s for _, event, task in due if event.compute_s > 0}
                for result in delivery.results:
                    if result.task_id in planned:
                        result.metrics["train_wall_s"] = planned[result.task_id]
            if self.observers:
                trained = {task.task_id: task for _, _, task in due}
                for result in delivery.results:
                    for observe in self.observers:
                        observe(trained[result.task_id], result)
            if self.tamper is not None:
                by_id = {task.task_id: task for _, _, task in due}
                tampered = [(r, self.tamper(by_id[r.task_id], r)) for r in delivery.results]
                delivery.results = [t for _, t in tampered if t is not None]
                delivery.rejected += [(r.device_id, "invalid_message") for r, t in tampered if t is None]
        if self.clock is not None and self.fleet is not None:
            if len(due) < want and self.pending and deadline != float("inf"):
                last = deadline  # nothing more before the deadline: the coordinator waited it out
            if last is not None:
                self.clock.advance_to(max(last, self.clock.now()))
        return delivery

    def idle(self) -> bool:
        return not self.pending

    def cancel(self, round_index: int) -> None:
        for _, event, _ in self.pending:
            if event.round == round_index:
                event.outcome = "cancelled"
        self.pending = [item for item in self.pending if item[1].round != round_index]

    def drain_events(self) -> list[TaskEvent]:
        """Events recorded since the last call (the replay writes them to timeline.jsonl per round)."""
        events, self.events = self.events, []
        return events
