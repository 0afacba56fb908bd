"""Learning-rate schedules over rounds (each paper decays on the round index, not local steps)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from nestling.errors import ConfigError
from nestling.task_params import TrainParams

SCHEDULES = ("constant", "step", "cosine", "exponential")


@dataclass(frozen=True)
class LrSchedule:
    """lr at round t: constant; step (×gamma at each milestone fraction of T, NeFL: 0.5 and 0.75);
    cosine (FeDepth); exponential (×gamma per round, DepthFL: 0.998)."""

    kind: str = "step"
    lr: float = TrainParams.lr
    gamma: float = 0.1
    milestones: tuple[float, ...] = (0.5, 0.75)
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ConfigError(f"[train] unknown lr schedule '{self.kind}' (known: {', '.join(SCHEDULES)})")
        if self.lr <= 0:
            raise ConfigError(f"[train] lr must be > 0, got {self.lr}")

    def at(self, round_index: int, total_rounds: int) -> float:
        if self.kind == "constant":
            return self.lr
        if self.kind == "step":
            passed = sum(1 for m in self.milestones if round_index >= int(m * total_rounds))
            return self.lr * self.gamma**passed
        if self.kind == "cosine":
            progress = round_index / max(1, total_rounds)
            return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))
        return self.lr * self.gamma**round_index
