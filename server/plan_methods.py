"""`nestling plan` per method: a method that can plan a fleet implements `Plannable` and says how.

CLI glue only: it imports server.strategies lazily and dispatches on the capability; each method's plan lives
with the method (server/strategies/planning.py, scalefl.py, fedepth.py), the rules in profiler/planner.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nestling.errors import ConfigError
from nestling.profiler.planner import DeviceBudget, PlanRow


def plannable_methods() -> dict[str, str]:
    """Method name -> how it plans (its `planning` word), for every registered strategy that is `Plannable`."""
    from nestling.server.strategies import STRATEGIES
    from nestling.server.strategies.planning import Plannable

    return {name: cls.planning for name, cls in sorted(STRATEGIES.items()) if issubclass(cls, Plannable)}


def plan_rows(
    method: str,
    arch: str,
    devices: Sequence[DeviceBudget],
    *,
    batch: int = 32,
    shape: tuple[int, int, int] = (3, 32, 32),
    classes: int = 10,
    levels: int = 4,
    tolerance: float = 0.05,
    options: dict[str, Any] | None = None,
) -> tuple[list[PlanRow], dict[str, Any]]:
    """Rows for every device plus method facts worth recording (ScaleFL levels, FeDepth budgets)."""
    from nestling.server.strategies import STRATEGIES
    from nestling.server.strategies.planning import Plannable, PlanRequest

    kinds = plannable_methods()
    cls = STRATEGIES.get(method)
    if cls is None or not issubclass(cls, Plannable):
        raise ConfigError(f"[plan] method '{method}' has nothing to plan (plannable: {', '.join(kinds)})")
    if not devices:
        raise ConfigError("[plan] no devices: give profiles and/or --budget-mb")
    request = PlanRequest(arch, devices, batch, shape, classes, levels, tolerance, dict(options or {}))
    plan = cls.plan_fleet(request)
    return plan.rows, plan.facts
