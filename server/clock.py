"""Clocks the coordinator reads: wall time for fleets, virtual time for trace replay."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class WallClock:
    """Monotonic seconds since the clock was made."""

    def __init__(self) -> None:
        self._start = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._start


class VirtualClock:
    """Time that moves only when the simulation says so, and never backwards."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t < self._now - 1e-12:
            raise ValueError(f"virtual clock cannot go back from {self._now} to {t}")
        self._now = max(self._now, float(t))

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot advance by negative {seconds}")
        self._now += seconds
