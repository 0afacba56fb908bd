"""The fleet transport's own time inside a round, which a board's link time does not include.

A replay's duration model (simulator/durations.py) charges each task its board's link: the task's tensors at the
board's downlink plus one latency, the result's at its uplink plus one latency, the way an emulating agent paces
them from the task's first chunk to the result's publication. What a real fleet pays besides, and a replay skips
unless `[run] transport_time = "fixed"` says how much (its keys are `transport_` and the names below):

- the server encodes and publishes a round's tasks one after another, so the k-th board's task leaves the server
  only when the tasks before it have: each task costs `dispatch_s` seconds plus `dispatch_s_per_mb` per MB
  (10^6 bytes) of its tensors, in dispatch order;
- every message crosses the broker: `hop_s` seconds from the server to the board (until its first chunk arrives)
  and again from the board to the server;
- the server reassembles and decodes each result: `collect_s_per_mb` per MB of the result's tensors.

So task k (0-based, in the order the strategy dispatched them) reaches its board at
`sum(dispatch_s + dispatch_s_per_mb * MB_j for j <= k) + hop_s` after the round's dispatch; its board's
availability is read at that moment; its result is in the server's hands `hop_s + collect_s_per_mb * MB_k` after
the board sent it. A board that leaves mid-task is noticed a hop later. `benchmarks/_fidelity_transport.py`
measures the four figures for a server, broker and model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nestling.config import TRANSPORT_TIME_KEYS, RunSection
from nestling.messages import Task
from nestling.profiler.speed import payload_bytes

MB = 1e6


@dataclass(frozen=True)
class TransportTime:
    """Seconds the fleet transport adds to each task of a round (all zero: `transport_time = "none"`)."""

    dispatch_s: float = 0.0
    dispatch_s_per_mb: float = 0.0
    hop_s: float = 0.0
    collect_s_per_mb: float = 0.0

    @property
    def mode(self) -> str:
        return "none" if self == TransportTime() else "fixed"

    def task_s(self, task: Task) -> float:
        """The server's serial time to encode and publish `task`."""
        return self.dispatch_s + self.dispatch_s_per_mb * payload_bytes(task.weights) / MB

    def reach_s(self, tasks: Sequence[Task]) -> list[float]:
        """Seconds after the round's dispatch at which each task's first chunk reaches its board."""
        leads, sent = [], 0.0
        for task in tasks:
            sent += self.task_s(task)
            leads.append(sent + self.hop_s)
        return leads

    def return_s(self, task: Task) -> float:
        """Seconds from the board sending `task`'s result to the server holding it decoded (the same tensors
        come back)."""
        return self.hop_s + self.collect_s_per_mb * payload_bytes(task.weights) / MB


def transport_time_for(run: RunSection) -> TransportTime:
    """The model `[run] transport_time` names (nestling/config.py validated its keys)."""
    if run.transport_time != "fixed":
        return TransportTime()
    return TransportTime(*(getattr(run, key) or 0.0 for key in TRANSPORT_TIME_KEYS))
