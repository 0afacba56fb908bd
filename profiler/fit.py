"""Which submodel a board trains, from what it measured: memory must fit, local training must fit the deadline.

`fit_member` is the one rule every method that sizes work by device uses (server/strategies/base.py calls it
from `Strategy.fit_by_budget`): among the candidate specs, the one with the most estimated training memory whose
memory fits the board's budget and whose predicted local training time (the board's profile, corrected by what
it has done so far) fits the time allowed. Each choice says why. `SpeedFeedback` is that correction: an EWMA of
observed over predicted training time per board.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from nestling.profiler.board_profile import BoardProfile
from nestling.profiler.estimator import estimate
from nestling.spec import SubmodelSpec

# Reasons a plan records.
UNCONSTRAINED = "unconstrained"  # the largest candidate fits both limits
MEMORY_BOUND = "memory-bound"  # the next larger candidate does not fit in memory
TIME_BOUND = "time-bound"  # the next larger candidate fits in memory but would miss the deadline
FALLBACK = "fallback"  # nothing fits: the cheapest candidate
PINNED = "pinned"  # the board pinned its tier ([device] tier)
# A larger submodel than the board trains now must fit the time with this much room to spare: a board near
# the edge does not flip between two submodels every round on timing noise.
UPSIZE_HEADROOM = 0.1


@dataclass(frozen=True)
class Fit:
    """One board's sizing: the chosen candidate, why, and what it is predicted to cost."""

    index: int
    reason: str
    memory_bytes: int
    budget_bytes: int | None
    predicted_s: float | None = None  # local training time, corrected by the board's speed factor
    time_budget_s: float | None = None
    speed: float = 1.0


def fit_member(
    specs: Sequence[SubmodelSpec],
    batch: int,
    *,
    memory_budget: int | None,
    board: BoardProfile | None = None,
    samples: int = 0,
    steps: int | None = None,
    time_budget_s: float | None = None,
    speed: float = 1.0,
    current: int | None = None,
    momentum: bool = True,
) -> Fit:
    """The costliest candidate that fits memory (`memory_budget`, else the profile's) and time (the profile's
    prediction of `samples` samples in `steps` steps × `speed` ≤ `time_budget_s`); the cheapest (FALLBACK) when
    none does. Without a profile or a time budget only memory counts, exactly as `planner.member_for_budget`.
    `current` is what the board trains now: a candidate costlier than it must fit the time with UPSIZE_HEADROOM
    to spare."""
    if not specs:
        raise ValueError("fit_member needs at least one candidate spec")
    budget = memory_budget if memory_budget is not None else (board.memory_bytes if board else None)
    memory = [estimate(s, batch, momentum=momentum).training_bytes for s in specs]
    timed = board is not None and time_budget_s is not None
    seconds = (
        [board.train_seconds(s, samples, steps) * speed if timed else None for s in specs] if board else None
    )
    now = memory[current] if current is not None and 0 <= current < len(specs) else None

    def fits_memory(k: int) -> bool:
        return budget is None or memory[k] <= budget

    def fits_time(k: int) -> bool:
        if not timed or seconds is None:
            return True
        allowed = float(time_budget_s)  # type: ignore[arg-type]
        if now is not None and memory[k] > now:
            allowed /= 1.0 + UPSIZE_HEADROOM
        return float(seconds[k]) <= allowed  # type: ignore[arg-type]

    order = sorted(range(len(specs)), key=lambda k: memory[k])
    fitting = [k for k in order if fits_memory(k) and fits_time(k)]
    if not fitting:
        chosen, reason = order[0], FALLBACK
    else:
        chosen = max(fitting, key=lambda k: memory[k])
        larger = [k for k in order if memory[k] > memory[chosen]]
        if not larger:
            reason = UNCONSTRAINED
        else:
            reason = MEMORY_BOUND if not fits_memory(larger[0]) else TIME_BOUND
    predicted = None
    if board is not None:
        predicted = board.train_seconds(specs[chosen], samples, steps) * speed
    return Fit(chosen, reason, int(memory[chosen]), budget, predicted, time_budget_s, speed)


@dataclass
class SpeedFeedback:
    """Per board: EWMA of observed / predicted local training time (1 = the profile is right).

    A board that missed the deadline reports nothing; its round's length is a lower bound of its time and
    counts as an observation (`censored`), so a board slowed past the deadline is still caught."""

    alpha: float = 0.6
    factors: dict[str, float] = field(default_factory=dict)

    def factor(self, device_id: str) -> float:
        return self.factors.get(device_id, 1.0)

    def observe(self, device_id: str, predicted_s: float, observed_s: float, censored: bool = False) -> float:
        """Fold one round in; returns the board's new factor. `predicted_s` is the uncorrected prediction."""
        if not (predicted_s > 0 and observed_s > 0):
            return self.factor(device_id)
        ratio = observed_s / predicted_s
        old = self.factor(device_id)
        if censored:
            ratio = max(ratio, old)  # at least this slow: never speeds a board up
        new = ratio if device_id not in self.factors else self.alpha * ratio + (1 - self.alpha) * old
        self.factors[device_id] = min(max(new, 1e-3), 1e3)
        return self.factors[device_id]


__all__ = [
    "FALLBACK",
    "MEMORY_BOUND",
    "PINNED",
    "TIME_BOUND",
    "UNCONSTRAINED",
    "UPSIZE_HEADROOM",
    "Fit",
    "SpeedFeedback",
    "fit_member",
]
