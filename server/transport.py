"""The Transport interface the coordinator talks to (in-process for simulation, MQTT for fleets)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from nestling.messages import Result, Task
from nestling.server.strategies.base import DeviceInfo


@dataclass
class Delivery:
    """What arrived while the coordinator waited: results, plus devices seen leaving (LWT, trace)."""

    results: list[Result] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # device ids that went offline with a task
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (device id, reason) refused on arrival


class Transport(Protocol):
    """How tasks reach devices and results come back; the coordinator never knows which world it is in."""

    def devices(self) -> list[DeviceInfo]:
        """Devices registered and available now."""
        ...

    def dispatch(self, tasks: list[Task]) -> None:
        """Send tasks (non-blocking)."""
        ...

    def wait(self, deadline: float, want: int) -> Delivery:
        """Block (wall clock) or advance (virtual clock) until something arrives or `deadline`; may return
        fewer than `want` results. Returning an empty delivery with `idle()` true means nothing is pending."""
        ...

    def idle(self) -> bool:
        """True when no dispatched task can still produce a result."""
        ...

    def cancel(self, round_index: int) -> None:
        """The round closed: results for it that arrive later are late and will be discarded."""
        ...

    # Optional: `reopen(task_id)` — the coordinator refused a delivered result for a reason the device can
    # fix (validation, screening); a corrected result for the same task must still be accepted. Transports
    # that never see a second result for a task (in-process) need not define it.
