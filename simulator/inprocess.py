"""In-process transport: tasks go to a Backend; arrival times come from a duration model on the clock."""

from __future__ import annotations

from collections.abc import Callable

from nestling.messages import Result, Task
from server.clock import VirtualClock
from server.strategies.base import DeviceInfo
from server.transport import Delivery
from simulator.backend import Backend

# task → (seconds until its result arrives, or None when the device drops out before finishing)
DurationModel = Callable[[Task, float], float | None]


class InProcessTransport:
    """Delivers tasks to simulated devices without a network.

    Without a duration model every result arrives as soon as it is trained (wall-clock runs). With one
    (trace replay), results arrive at predicted virtual times and only the results the coordinator
    will use are actually trained."""

    def __init__(self, devices: list[DeviceInfo], backend: Backend, clock: VirtualClock | None = None,
                 duration: DurationModel | None = None,
                 available: Callable[[DeviceInfo, float], bool] | None = None) -> None:
        self._devices = devices
        self.backend = backend
        self.clock = clock
        self.duration = duration
        self.available = available
        self.pending: list[tuple[float, Task]] = []
        self.dropped: list[str] = []

    def devices(self) -> list[DeviceInfo]:
        if self.available is None or self.clock is None:
            return list(self._devices)
        now = self.clock.now()
        return [d for d in self._devices if self.available(d, now)]

    def dispatch(self, tasks: list[Task]) -> None:
        now = self.clock.now() if self.clock is not None else 0.0
        for task in tasks:
            seconds = self.duration(task, now) if self.duration is not None else 0.0
            if seconds is None:
                self.dropped.append(task.device_id)
            else:
                self.pending.append((now + seconds, task))
        self.pending.sort(key=lambda item: (item[0], item[1].device_id))

    def wait(self, deadline: float, want: int) -> Delivery:
        delivery = Delivery(dropped=self.dropped)
        self.dropped = []
        due = [(t, task) for t, task in self.pending if t <= deadline][:max(0, want)]
        if not due:
            if self.clock is not None and self.pending and deadline != float("inf"):
                self.clock.advance_to(deadline)
            return delivery
        chosen = {id(task) for _, task in due}
        self.pending = [(t, task) for t, task in self.pending if id(task) not in chosen]
        results: list[Result] = self.backend.run([task for _, task in due])
        if self.clock is not None and self.duration is not None:
            self.clock.advance_to(max(t for t, _ in due))
        delivery.results = results
        return delivery

    def idle(self) -> bool:
        return not self.pending

    def cancel(self, round_index: int) -> None:
        self.pending = [(t, task) for t, task in self.pending if task.round != round_index]
