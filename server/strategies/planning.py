"""`nestling plan` asks a method for its plan: a method that turns a fleet's memory budgets into what each board
trains implements `Plannable`, and the planner's callers dispatch on that capability, never on the method's name.

The planning rules themselves live in profiler/planner.py; a method only says which of its submodels (or depth
decompositions) are the candidates: a family of submodels (HeteroFL, FjORD, NeFL), ScaleFL's budget-clustered
levels, FeDepth's per-budget stages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

from nestling.profiler.planner import DeviceBudget, PlanRow, plan_family
from nestling.server.strategies.context import StrategyContext
from nestling.spec import SubmodelSpec
from nestling.task_params import TrainParams


@dataclass(frozen=True)
class PlanRequest:
    """What `nestling plan` was asked: the fleet's budgets, the model and the run's batch, and the method's
    options (`--option`); `levels` and `tolerance` are ScaleFL's k and ε, FeDepth's τ."""

    arch: str
    devices: Sequence[DeviceBudget]
    batch: int = TrainParams.batch_size
    shape: tuple[int, int, int] = (3, 32, 32)
    classes: int = 10
    levels: int = 4
    tolerance: float = 0.05
    options: Mapping[str, Any] = field(default_factory=dict)

    def context(self, options: Mapping[str, Any]) -> StrategyContext:
        """A one-round context for building the method's strategy: one client per device, momentum SGD."""
        return StrategyContext(
            arch=self.arch,
            num_classes=self.classes,
            in_channels=self.shape[0],
            image_size=self.shape[1],
            num_clients=max(1, len(self.devices)),
            total_rounds=1,
            local={"batch_size": self.batch, "momentum": 0.9},
            options=dict(options),
        )


@dataclass(frozen=True)
class FleetPlan:
    """Each device's row, and the method's facts worth recording in plan.json (ScaleFL levels, FeDepth budgets)."""

    rows: list[PlanRow]
    facts: dict[str, Any] = field(default_factory=dict)


class Plannable(ABC):
    """A method `nestling plan --method NAME` can plan for."""

    # How it plans, in a word: the README's `nestling plan` column ("family", "levels", "depthwise").
    planning: ClassVar[str]

    @classmethod
    @abstractmethod
    def plan_fleet(cls, request: PlanRequest) -> FleetPlan:
        """The plan of every device in `request` under this method."""


class FamilyPlanning(Plannable):
    """A method with a fixed family of submodels: every board gets the largest member that fits it."""

    planning: ClassVar[str] = "family"

    @abstractmethod
    def family(self) -> tuple[list[str], list[SubmodelSpec]]:
        """(labels, specs) of the family, smallest first."""

    @classmethod
    def plan_fleet(cls, request: PlanRequest) -> FleetPlan:
        # The family is the strategy's own, built as a run with these options would build it.
        build = cast(Callable[[StrategyContext], FamilyPlanning], cls)
        labels, specs = build(request.context(request.options)).family()
        return FleetPlan(plan_family(labels, specs, request.devices, request.batch))
