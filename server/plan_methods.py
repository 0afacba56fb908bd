"""`nestling plan` per method: families and decompositions come from the strategies themselves.

CLI glue only: it imports server.strategies lazily (the strategies own the families, ScaleFL's grid
search and FeDepth's budgets); the planning logic itself lives in profiler/planner.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nestling.errors import ConfigError
from nestling.profiler.estimator import estimate
from nestling.profiler.planner import (
    DeviceBudget,
    PlanRow,
    assign_levels,
    cluster_budget_fractions,
    plan_depthwise,
    plan_family,
    scalefl_level_specs,
    scalefl_memory_levels,
)
from nestling.spec import SubmodelSpec

PLANNING_KINDS = ("family", "levels", "depthwise")


def plannable_methods() -> dict[str, str]:
    """Method name -> how it plans, read from each registered strategy's `planning` declaration."""
    from nestling.server.strategies import STRATEGIES

    return {
        name: str(cls.planning) for name, cls in sorted(STRATEGIES.items()) if cls.planning in PLANNING_KINDS
    }


def _strategy(
    method: str,
    arch: str,
    shape: tuple[int, int, int],
    classes: int,
    clients: int,
    batch: int,
    options: dict[str, Any],
) -> Any:
    from nestling.server.strategies import StrategyContext, create_strategy

    ctx = StrategyContext(
        arch=arch,
        num_classes=classes,
        in_channels=shape[0],
        image_size=shape[1],
        num_clients=max(1, clients),
        total_rounds=1,
        local={"batch_size": batch, "momentum": 0.9},
        options=options,
    )
    return create_strategy(method, ctx)


def family_of(strategy: Any) -> tuple[list[str], list[SubmodelSpec]]:
    """(labels, specs) of a width/depth family strategy, smallest first."""
    specs = strategy.specs
    if isinstance(specs, dict):
        keys = sorted(specs)
        return [f"w{k:.3g}" for k in keys], [specs[k] for k in keys]
    return [f"k{i + 1}" for i in range(len(specs))], list(specs)


def _scalefl_plan(
    arch: str,
    shape: tuple[int, int, int],
    classes: int,
    devices: Sequence[DeviceBudget],
    batch: int,
    levels: int,
    tolerance: float,
) -> tuple[list[PlanRow], dict[str, Any]]:
    """k-means of the budgets into levels (§6.a.1), a memory-cost split per level, largest fitting level each."""
    from nestling.server.strategies import StrategyContext

    ctx = StrategyContext(
        arch=arch,
        num_classes=classes,
        in_channels=shape[0],
        image_size=shape[1],
        num_clients=1,
        total_rounds=1,
    )
    # The ScaleFL model family (server/strategies/scalefl.py): ScaleFL exits, Scaler, batch statistics, floor.
    base = ctx.model_config(exit_kind="scalefl", scaler="always", norm_stats="batch", rounding="floor")
    full = estimate(SubmodelSpec(base), batch).training_bytes
    fractions = cluster_budget_fractions([d.memory_bytes for d in devices], levels, full)[:-1]
    found = scalefl_memory_levels(base, [int(f * full) for f in fractions], batch, tolerance=tolerance)
    specs = scalefl_level_specs(base, found)
    rows = assign_levels(specs, devices, batch)
    extra = {
        "levels": [
            {
                "width": lv.width,
                "depth": lv.depth,
                "memory_bytes": lv.memory_bytes,
                "target_bytes": lv.target_bytes,
            }
            for lv in found
        ]
        + [
            {
                "width": 1.0,
                "depth": None,
                "memory_bytes": estimate(specs[-1], batch).training_bytes,
                "target_bytes": full,
            }
        ],
        # What the ScaleFL strategy takes to train exactly these levels: --set method.grid='...'
        "strategy_options": {"grid": [[lv.width, lv.depth] for lv in found]},
    }
    return rows, extra


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
    kinds = plannable_methods()
    if method not in kinds:
        raise ConfigError(f"[plan] method '{method}' has nothing to plan (plannable: {', '.join(kinds)})")
    if not devices:
        raise ConfigError("[plan] no devices: give profiles and/or --budget-mb")
    options = dict(options or {})
    if kinds[method] == "family":
        labels, specs = family_of(_strategy(method, arch, shape, classes, len(devices), batch, options))
        return plan_family(labels, specs, devices, batch), {}
    if kinds[method] == "levels":
        return _scalefl_plan(arch, shape, classes, devices, batch, levels, tolerance)
    strategy = _strategy(
        method, arch, shape, classes, len(devices), batch, {"tolerance": tolerance, **options}
    )
    full_cost = estimate(strategy.full_spec, batch, momentum=True)
    rows = plan_depthwise(
        strategy.costs,
        full_cost,
        devices,
        tolerance=tolerance,
        plan_of=strategy.plan_for_budget,
        stem_every_stage=strategy.stem_every_stage,
    )
    extra = {
        "budgets": {f"{r:.4g}": b for r, b in strategy.ratio_bytes.items()},
        "block_bytes": [int(b) for b in strategy.costs.blocks],
        "stem_bytes": int(strategy.costs.stem),
    }
    return rows, extra
