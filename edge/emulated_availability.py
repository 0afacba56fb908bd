"""An emulated board that comes and goes as its trace says: it leaves the broker when an availability window
closes (abandoning the task it holds, whose result then never comes) and registers again when the next opens.

`nestling agent --emulate-trace T --emulate-device ID --emulate-availability [--emulate-time-scale S]`. The
trace's clock starts when the agent first hears the server announce a training round (the fleet's first
round, as t = 0 is the replay's first round) and runs S trace seconds per wall second, so a day of churn
fits in minutes; the simulator replays the same windows from `profiler.traces.time_scaled(trace, S)`.
Leaving is real: the agent marks itself offline and disconnects, the server drops its task as it would a
board whose battery died, and nothing it trained for that task is sent, then or after it returns.

The same interruption serves over-selection: when the server announces that the round of the task being
padded has closed, the emulated board stops there (the replay frees a cancelled straggler at the close).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from nestling.edge.agent_link import AgentLink
from nestling.profiler.traces import DeviceTrace

log = logging.getLogger("nestling.agent")

# The server's phases that announce its round closed ("waiting" names the round about to start).
CLOSED_PHASES = ("aggregating", "done")

_LONGEST_SLEEP_S = 60.0  # a last window "forever" (1e12 s) would overflow threading's timeout

# A window must stay open this long (wall seconds) to be worth reconnecting for, as the replay ignores
# zero-length windows.
_SHORTEST_STAY_S = 1e-3


class TaskInterruption:
    """Why the task being worked on must stop now (the board left, or its round closed), if it must."""

    def __init__(self, stopping: threading.Event) -> None:
        self._stopping = stopping
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.task_round: int | None = None
        self.reason: str | None = None
        self.left_at = -math.inf  # monotonic time the board last left
        self.task_session: str | None = None
        self.closed: dict[str, int] = {}  # server session -> the newest round it announced closed

    def begin(self, round_index: int, received: float, session: str) -> str | None:
        """A task of `round_index` from server `session` (its download began at `received`) starts; why it
        must not, if so."""
        with self._lock:
            self._event.clear()
            if received <= self.left_at:
                self.task_round, self.reason = None, "it arrived before the board left"
            elif self.closed.get(session, -1) >= round_index:
                self.task_round, self.reason = None, "its round closed"
            else:
                self.task_round, self.reason = round_index, None
                self.task_session = session
            return self.reason

    def end(self) -> None:
        with self._lock:
            self.task_round = None

    def departed(self) -> None:
        """The board left: the task it holds is lost, and so is any it had received but not started."""
        with self._lock:
            self.left_at = time.monotonic()
            self._stop("the board left (its availability window closed)")

    def round_closed(self, round_index: int, session: str) -> None:
        """Server `session` closed `round_index`: a task of that round is a cancelled straggler's (another
        session's rounds, e.g. a retained status left by an earlier run, do not count)."""
        with self._lock:
            self.closed[session] = max(self.closed.get(session, -1), round_index)
            if (
                self.task_round is not None
                and self.task_session == session
                and self.task_round <= round_index
            ):
                self._stop("its round closed")

    def _stop(self, reason: str) -> None:
        if self.task_round is not None and self.reason is None:
            self.reason = reason
        self._event.set()

    @property
    def interrupted(self) -> bool:
        return self.reason is not None

    def sleep(self, seconds: float) -> bool:
        """The pacer's sleep: wait `seconds`, cut short by an interruption or the agent stopping."""
        give_up = time.monotonic() + max(0.0, seconds)
        while not self._event.is_set() and not self._stopping.is_set():
            left = give_up - time.monotonic()
            if left <= 0:
                break
            self._event.wait(min(left, 0.1))
        return self._event.is_set()


class EmulatedAvailability:
    """Takes the agent off the broker and back on as `trace`'s windows (already time-scaled) open and close."""

    def __init__(
        self,
        trace: DeviceTrace,
        link: AgentLink,
        interruption: TaskInterruption,
        stopping: threading.Event,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.trace = trace
        self.link = link
        self.interruption = interruption
        self._stopping = stopping
        self._clock = clock
        self.epoch: float | None = None  # monotonic time of the trace's t = 0
        self.away = False
        self.departures = 0
        self._thread: threading.Thread | None = None

    def trace_time(self) -> float | None:
        """Seconds of the (scaled) trace since its t = 0; None until the first round was announced."""
        return None if self.epoch is None else self._clock() - self.epoch

    def on_announcement(self, phase: str) -> None:
        """The server's status: its first training round starts the trace's clock."""
        if phase == "training" and self.epoch is None:
            self.epoch = self._clock()
            log.info("trace clock started (trace device %s)", self.trace.device_id)
            self._thread = threading.Thread(target=self._follow, name="agent-availability", daemon=True)
            self._thread.start()

    def _follow(self) -> None:
        """Leave when the window closes, come back when the next one opens, until the agent stops."""
        while not self._stopping.is_set():
            now = self.trace_time()
            assert now is not None
            if self.away:
                back = self.trace.next_available(now)
                while math.isfinite(back) and not self.trace.available_until(back) > back + _SHORTEST_STAY_S:
                    back = self.trace.next_available(
                        math.nextafter(self.trace.available_until(back), math.inf)
                    )
                if not math.isfinite(back):
                    return  # never online again: the board stays away
                if back > now:
                    if self._wait(back - now):
                        return
                    continue
                self._return()
            else:
                leave = self.trace.available_until(now)
                if not math.isfinite(leave):
                    return  # online from here on
                if leave > now:
                    if self._wait(leave - now):
                        return
                    continue
                self._leave()

    def _wait(self, seconds: float) -> bool:
        """Sleep on the wall clock (a minute at most, then the caller looks again); True when the agent stops."""
        return self._stopping.wait(min(max(0.0, seconds), _LONGEST_SLEEP_S))

    def _leave(self) -> None:
        self.away = True
        self.departures += 1
        self.interruption.departed()
        log.info(
            "leaving: trace device %s goes offline at trace time %.3f s",
            self.trace.device_id,
            self.trace_time(),
        )
        self.link.leave()

    def _return(self) -> None:
        log.info(
            "returning: trace device %s comes online at trace time %.3f s",
            self.trace.device_id,
            self.trace_time(),
        )
        self.away = False
        self.link.start()  # registers again once connected
