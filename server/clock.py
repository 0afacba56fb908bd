"""Clocks the coordinator reads: wall time for a real fleet, virtual time for trace replay."""

from __future__ import annotations

import math
import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """What the coordinator needs from time: read it and wait; it never knows which world it is in."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


def _duration(seconds: float) -> float:
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"cannot sleep for {seconds!r} seconds: need a finite, non-negative duration")
    return float(seconds)


class WallClock:
    """Real time for a deployed fleet; monotonic so NTP steps cannot reorder deadlines."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(_duration(seconds))


class VirtualClock:
    """Simulated time that only moves when told to, and never backwards."""

    def __init__(self, start: float = 0.0) -> None:
        if not math.isfinite(start):
            raise ValueError(f"virtual clock start must be finite, got {start!r}")
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        """Jump to time t (the next event); going back would reorder events already handled."""
        if not math.isfinite(t):
            raise ValueError(f"virtual clock can only move to a finite time, got {t!r}")
        if t < self._now:
            raise ValueError(f"virtual clock cannot go back from {self._now} to {t}")
        self._now = float(t)

    def sleep(self, seconds: float) -> None:
        """Returns at once: sleeping in simulation is advancing the clock."""
        self._now += _duration(seconds)
