"""The divergence guard: a round's aggregation is applied so that it can be undone, and undone when it failed,
left the global model non-finite or exploded, or (seen a round later) poisoned the model so that most boards'
next results came back non-finite. The boards whose updates an undone aggregation applied are quarantined."""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from nestling.aggregation import robust_rule
from nestling.messages import Result, Task
from nestling.server.screening import RobustPolicy, largest_magnitude
from nestling.server.strategies.base import DeviceInfo, Strategy

log = logging.getLogger("nestling.coordinator")

Snapshot = tuple[dict[str, torch.Tensor], dict[str, Any]]


class DivergenceGuard:
    """Aggregates through the strategy with a way back. Owns the state before the last applied aggregation,
    who that aggregation applied, the global model's last largest |w|, and the quarantine (device -> first
    round it may be selected again, and every quarantine for the run's summary)."""

    def __init__(self, strategy: Strategy, robust: RobustPolicy, scale: float | None = None) -> None:
        """`scale`: the global model's largest |w| when already known (a recorded round replayed), else measured
        at the first aggregation."""
        self.strategy = strategy
        self.robust = robust
        self.quarantine: dict[str, int] = {}
        self.quarantine_log: list[dict[str, Any]] = []
        self.seconds = 0.0  # aggregation under the guard: part of the robustness overhead
        self._before_last: Snapshot | None = None
        self._last_applied: tuple[int, list[str]] | None = None
        self._scale = scale  # largest |w| of the global model after the last aggregation

    def available(self, devices: list[DeviceInfo], round_index: int) -> list[DeviceInfo]:
        """The devices not quarantined in this round."""
        return [d for d in devices if self.quarantine.get(d.device_id, -1) <= round_index]

    def _snapshot(self) -> Snapshot:
        """The strategy's state before a round, by reference: `Strategy.aggregate` replaces state tensors and
        never writes into them (tests/server/strategies/test_state_contract.py holds every method to it), so
        no copy is needed; `load_state` copies when rolling back."""
        meta = self.strategy.state_meta()
        return dict(self.strategy.state_tensors()), json.loads(json.dumps(meta)) if meta else {}

    def aggregate(
        self, round_index: int, accepted: list[tuple[Task, Result]], counters: Counter[str]
    ) -> bool:
        """Aggregate; undo it (False) when it failed or left the model non-finite or exploded."""
        started = time.perf_counter()
        applied = self._aggregate(round_index, accepted, counters)
        self.seconds += time.perf_counter() - started
        return applied

    def _aggregate(
        self, round_index: int, accepted: list[tuple[Task, Result]], counters: Counter[str]
    ) -> bool:
        robust = self.robust
        before = self._snapshot() if robust.divergence_guard else None
        scale_before = 0.0
        if before is not None:
            scale_before = (
                self._scale if self._scale is not None else largest_magnitude(self.strategy.global_state)
            )
        try:
            with robust_rule(robust.aggregation, robust.trim_fraction, robust.bn_statistics):
                self.strategy.aggregate(round_index, accepted)
        except Exception as exc:  # a result that slipped past validation must not stop the run
            if before is None:
                raise
            log.error("round %d: aggregation failed (%r); global model rolled back", round_index, exc)
            counters["aggregation_failed"] += 1
            self.strategy.load_state(*before)
            return False
        if before is None:
            return True
        scale_after = largest_magnitude(self.strategy.global_state)
        if not math.isfinite(scale_after) or scale_after > robust.divergence_factor * max(scale_before, 1.0):
            log.error(
                "round %d: global model diverged (largest |w| %.3g -> %.3g); rolled back to the state "
                "before the round",
                round_index,
                scale_before,
                scale_after,
            )
            counters["rolled_back"] += 1
            self.strategy.load_state(*before)
            self._scale = scale_before
            return False
        self._before_last, self._scale = before, scale_after
        self._last_applied = (round_index, [r.device_id for _, r in accepted])
        return True

    def undo_previous(
        self, round_index: int, non_finite: set[str], judged: set[str], counters: Counter[str]
    ) -> tuple[int | None, list[str]]:
        """Most of this round's judged results non-finite: the previous round's aggregation poisoned the model;
        undo it and quarantine the boards it applied. Returns the round undone (or None) and those boards."""
        if (
            self._before_last is None
            or self._last_applied is None
            or self._last_applied[0] != round_index - 1
        ):
            return None, []
        if not non_finite or len(non_finite) * 2 <= len(judged):
            return None, []
        previous, devices = self._last_applied
        log.error(
            "round %d: most results are non-finite; rolling back round %d and quarantining %s",
            round_index,
            previous,
            ", ".join(devices),
        )
        counters["rolled_back"] += 1
        self.strategy.load_state(*self._before_last)
        self._before_last = self._last_applied = self._scale = None
        return previous, self.quarantine_devices(round_index, devices)

    def set_aside(self, round_index: int, until: dict[str, int], why: str) -> list[str]:
        """Skip each device until its round (boards the cohort screen kept refusing, server/strikes.py)."""
        for name, first in until.items():
            self.quarantine[name] = max(first, self.quarantine.get(name, -1))
            self.quarantine_log.append(
                {"round": round_index, "devices": [name], "until_round": first, "why": why}
            )
        return sorted(until)

    def restore(self, records: Iterable[dict[str, Any]]) -> None:
        """The quarantine as an uninterrupted run had it, from the metrics of the rounds a resume keeps."""
        for record in records:
            for name, first in (record.get("set_aside") or {}).items():
                self.quarantine[name] = max(int(first), self.quarantine.get(name, -1))

    def quarantine_devices(self, round_index: int, devices: Iterable[str]) -> list[str]:
        """Skip these devices for the policy's quarantine_rounds rounds after this one; their names, sorted."""
        names = sorted(devices)
        until = round_index + 1 + self.robust.quarantine_rounds
        for name in names:
            self.quarantine[name] = until
        if names:
            self.quarantine_log.append({"round": round_index, "devices": names, "until_round": until})
        return names
