"""The server's own time between a replay's rounds, which a fleet's wall clock spends and a virtual clock skips.

After a round closes, a fleet's server screens and aggregates the results, evaluates, writes a checkpoint, then
selects and assigns the next round; its boards' clocks (and their availability windows) run on meanwhile. A
replay's virtual clock stands still for all of it unless `[run] server_time` says how far to move it:

- `none` (default): not at all. The replay stays a pure function of its config and trace.
- `fixed`: `server_round_s` every round, plus `server_eval_s` on a round that evaluates and `server_checkpoint_s`
  on one that writes a checkpoint: what a deployment's server was measured to take.
- `measured`: the server work this process did for the round, timed on a monotonic clock (the round's wall time
  less the time the backend spent training the simulated boards), times `server_time_factor` (> 1 for a server
  slower than this machine). The replay then depends on this host's speed and load.

The clock moves once per round, after the round's record is written (its `virtual_time` and `closed_at` stay the
moment it closed) and before the next round asks who is online, so availability windows, dropouts and deadlines
of later rounds are read at the advanced clock. Each move is kept in the run folder's server_time.jsonl, which
`--resume` continues from.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from nestling.config import RunSection
from nestling.messages import Result, Task
from nestling.server.clock import VirtualClock
from nestling.server.coordinator import RoundRecord
from nestling.simulator.backend import Backend
from nestling.strict_json import strict_dumps

SERVER_TIME = "server_time.jsonl"


@dataclass(frozen=True)
class RoundWork:
    """What the server did for one round besides waiting for its boards."""

    round: int
    evaluated: bool
    checkpointed: bool
    measured_s: float  # wall seconds this process spent on it (monotonic clock)


class ServerTime(Protocol):
    """How many virtual seconds the server's work for one round takes."""

    @property
    def mode(self) -> str:
        """none, fixed or measured: the `[run] server_time` it models."""
        ...

    def seconds(self, work: RoundWork) -> float: ...


@dataclass(frozen=True)
class NoServerTime:
    """The virtual clock stands still between rounds (the server is infinitely fast)."""

    mode: str = "none"

    def seconds(self, work: RoundWork) -> float:
        return 0.0


@dataclass(frozen=True)
class FixedServerTime:
    """Seconds per round, plus seconds for an evaluation and for a checkpoint on the rounds that do them."""

    round_s: float = 0.0
    eval_s: float = 0.0
    checkpoint_s: float = 0.0
    mode: str = "fixed"

    def seconds(self, work: RoundWork) -> float:
        return self.round_s + self.eval_s * work.evaluated + self.checkpoint_s * work.checkpointed


@dataclass(frozen=True)
class MeasuredServerTime:
    """This process's own server work per round, scaled for a slower (> 1) or faster (< 1) server."""

    factor: float = 1.0
    mode: str = "measured"

    def seconds(self, work: RoundWork) -> float:
        return self.factor * work.measured_s


def server_time_for(run: RunSection) -> ServerTime:
    """The model `[run] server_time` names (nestling/config.py validated its keys)."""
    if run.server_time == "fixed":
        return FixedServerTime(
            run.server_round_s or 0.0, run.server_eval_s or 0.0, run.server_checkpoint_s or 0.0
        )
    if run.server_time == "measured":
        return MeasuredServerTime(1.0 if run.server_time_factor is None else run.server_time_factor)
    return NoServerTime()


def writes_checkpoint(round_index: int, rounds: int, checkpoint_every: int) -> bool:
    """Whether the coordinator checkpoints after this round: every `checkpoint_every` rounds, and the last."""
    return round_index == rounds - 1 or (checkpoint_every > 0 and (round_index + 1) % checkpoint_every == 0)


class TimedBackend:
    """A backend that adds up the wall time spent training the simulated boards, which is not server work."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.stores = backend.stores
        self.training_s = 0.0

    def run(self, tasks: list[Task]) -> list[Result]:
        started = time.perf_counter()
        try:
            return self.backend.run(tasks)
        finally:
            self.training_s += time.perf_counter() - started

    def close(self) -> None:
        self.backend.close()

    def take_training_seconds(self) -> float:
        """Training seconds since the last call."""
        spent, self.training_s = self.training_s, 0.0
        return spent


class ServerClock:
    """Moves a replay's virtual clock by the server's time after each round and keeps server_time.jsonl."""

    def __init__(
        self,
        model: ServerTime,
        clock: VirtualClock,
        backend: TimedBackend,
        out_dir: Path,
        rounds: int,
        checkpoint_every: int,
    ) -> None:
        self.model = model
        self.clock = clock
        self.backend = backend
        self.path = out_dir / SERVER_TIME
        self.rounds = rounds
        self.checkpoint_every = checkpoint_every
        self._mark = time.perf_counter()

    def start(self, resume_round: int | None) -> float:
        """Fresh run: no moves yet. Resumed: later rounds' moves dropped; returns the last kept round's move,
        which its `virtual_time` (the round's close) does not include."""
        self._mark = time.perf_counter()
        if resume_round is None or not self.path.exists():
            self.path.unlink(missing_ok=True)
            return 0.0
        kept = [row for row in read_server_time(self.path.parent) if row["round"] < resume_round]
        self.path.write_text("".join(strict_dumps(row) + "\n" for row in kept))
        last = [row for row in kept if row["round"] == resume_round - 1]
        return float(last[-1]["server_s"]) if last else 0.0

    def after_round(self, record: RoundRecord) -> float:
        """Time the round's server work, move the clock by the model's seconds for it; returns them."""
        wall = time.perf_counter() - self._mark
        work = RoundWork(
            record.round,
            evaluated=bool(record.submodels),
            checkpointed=writes_checkpoint(record.round, self.rounds, self.checkpoint_every),
            measured_s=max(0.0, wall - self.backend.take_training_seconds()),
        )
        seconds = self.model.seconds(work)
        closed = self.clock.now()
        self.clock.advance_to(closed + seconds)
        if self.model.mode != "none":
            row = {
                "round": work.round,
                "mode": self.model.mode,
                "server_s": seconds,
                "measured_s": work.measured_s,
                "evaluated": work.evaluated,
                "checkpointed": work.checkpointed,
                "closed_at": closed,
                "next_round_at": self.clock.now(),
            }
            with self.path.open("a") as stream:
                stream.write(strict_dumps(row) + "\n")
        return seconds

    def restart_timing(self) -> None:
        """The next round's server work is timed from here (the replay's own bookkeeping is not server work)."""
        self._mark = time.perf_counter()

    def summary(self) -> dict[str, Any]:
        rows = read_server_time(self.path.parent)
        return {
            "mode": self.model.mode,
            "seconds": sum(float(row["server_s"]) for row in rows),
            "measured_seconds": sum(float(row["measured_s"]) for row in rows),
            "rounds": len(rows),
        }


def read_server_time(out_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run folder's server_time.jsonl (none for a replay that did not move its clock)."""
    path = out_dir / SERVER_TIME
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
