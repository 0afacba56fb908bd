"""One board's bad input is refused, never the server's failure: assignments and reported metrics, guarded.

The wire schema (nestling/wire/schemas.py) refuses what it can name at the door. What slips past it (a
strategy's own arithmetic on a board's figures, a plugin's metric) is caught here per board: the board is
left out of the round and counted, and the round goes on with the others.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from nestling.messages import Result, Task
from nestling.server.strategies.base import DeviceInfo, Strategy

log = logging.getLogger("nestling.coordinator")

ASSIGN_REFUSED = "rejected_assign"  # counter: a board whose assignment raised (its hello's figures)


def assign_guarded(
    strategy: Strategy,
    round_index: int,
    selected: list[DeviceInfo],
    refuse: Callable[[str, str], None],
) -> dict[str, Task]:
    """`strategy.assign` for the selected boards; when it raises, the boards whose own assignment raises are
    refused (`refuse(device_id, detail)`) and the rest assigned together. An error no single board causes is
    the server's own and is raised."""
    try:
        return strategy.assign(round_index, selected)
    except Exception as whole:
        failing: list[DeviceInfo] = []
        for device in selected:
            try:
                strategy.assign(round_index, [device])
            except Exception as exc:
                failing.append(device)
                refuse(device.device_id, repr(exc)[:200])
        if not failing:
            raise
        log.warning(
            "round %d: %d board(s) could not be assigned (%r); the round goes on without them",
            round_index,
            len(failing),
            whole,
        )
        rest = [d for d in selected if d not in failing]
        return strategy.assign(round_index, rest) if rest else {}


def finite_metric(metrics: dict[str, Any], name: str) -> float | None:
    """A reported number if it is one (finite, not a bool), else None: a metric never raises in the server."""
    value = metrics.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float range
        return None
    return number if math.isfinite(number) else None


def local_train_seconds(accepted: list[tuple[Task, Result]]) -> float:
    """Σ of the training seconds the boards reported (compute-seconds, all workers)."""
    return sum(finite_metric(r.metrics, "train_seconds") or 0.0 for _, r in accepted)


def mean_train_loss(accepted: list[tuple[Task, Result]]) -> float | None:
    """Mean of the boards' reported mean losses (None when no board reported a finite one)."""
    losses = [finite_metric(r.metrics, "loss_mean") for _, r in accepted]
    numbers = [loss for loss in losses if loss is not None]
    return sum(numbers) / len(numbers) if numbers else None


def observed_seconds(
    plans: dict[str, dict[str, Any]], accepted: list[tuple[Task, Result]], elapsed: float
) -> dict[str, tuple[float, bool]]:
    """Each planned board's local training seconds: what its result reports (an emulated board's padded
    time, `train_wall_s`, else `train_seconds`), or, without a result, the round's length as a lower bound."""
    observed: dict[str, tuple[float, bool]] = {}
    for _, result in accepted:
        seconds = finite_metric(result.metrics, "train_wall_s")
        if seconds is None:
            seconds = finite_metric(result.metrics, "train_seconds")
        if seconds is not None:
            observed[result.device_id] = (seconds, False)
    for device_id in plans:
        if device_id not in observed and elapsed > 0:
            observed[device_id] = (float(elapsed), True)
    return observed
