"""Budgets → training plans: the largest family member that fits, ScaleFL levels by k-means, FeDepth stages."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from nestling.errors import ConfigError
from nestling.models.config import ModelConfig
from nestling.models.zoo import block_infos
from nestling.profiler.decompose import DEFAULT_TOLERANCE, DepthCosts, StagePlan
from nestling.profiler.estimator import ModelCost, estimate
from nestling.spec import SubmodelSpec


@dataclass(frozen=True)
class DeviceBudget:
    """What one device may spend per training step: memory, and optionally time.

    Step time is predicted from the device's own profile when it has one (its measured step scaled by
    training MACs), else from its measured sustained GFLOP/s (an optimistic bound)."""

    name: str
    memory_bytes: int
    gflops: float | None = None
    step_ms_budget: float | None = None
    reference: tuple[float, float] | None = None  # (measured step ms, training MACs of that step)

    def step_ms(self, training_macs_per_step: float) -> float | None:
        if self.reference is not None and self.reference[1] > 0:
            return self.reference[0] * training_macs_per_step / self.reference[1]
        if self.gflops:
            return 2.0 * training_macs_per_step / (self.gflops * 1e9) * 1000.0
        return None

    def allows(self, memory: float, step_ms: float | None, tolerance: float = 0.0) -> bool:
        if memory > self.memory_bytes * (1.0 + tolerance):
            return False
        return self.step_ms_budget is None or step_ms is None or step_ms <= self.step_ms_budget

    @classmethod
    def from_profile(
        cls,
        profile: dict[str, Any],
        *,
        memory_bytes: int | None = None,
        memory_fraction: float = 0.5,
        step_ms_budget: float | None = None,
    ) -> DeviceBudget:
        """Budget of a profiled device: given bytes, the profile's own budget, or a share of available RAM."""
        device = profile.get("device", {})
        name = str(profile.get("name") or device.get("hostname") or "device")
        if memory_bytes is None:
            memory_bytes = (profile.get("budget") or {}).get("memory_bytes")
        if memory_bytes is None:
            gpu = device.get("gpu")
            available = gpu["free_bytes"] if gpu else device.get("memory", {}).get("available_bytes")
            if available is None:
                raise ConfigError(f"profile '{name}' has no memory figures: give --budget-mb")
            memory_bytes = int(available * memory_fraction)
        reference = None
        if "model" in profile and "total" in profile:
            spec = SubmodelSpec.from_dict(profile["model"]["spec"])
            batch = int(profile["model"]["batch"])
            reference = (
                float(profile["total"]["step_ms"]["median"]),
                float(estimate(spec, batch).training_macs * batch),
            )
        gflops = (device.get("compute") or {}).get("gflops")
        return cls(name, int(memory_bytes), gflops, step_ms_budget, reference)


@dataclass
class PlanRow:
    """One device's assignment with the estimates it rests on."""

    device: str
    budget_bytes: int
    label: str
    spec: dict[str, Any] | None
    params: int
    training_macs: int  # per step (batch included)
    memory_bytes: int
    step_ms: float | None
    fits: bool
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _row(
    device: DeviceBudget,
    label: str,
    cost: ModelCost,
    memory: float,
    step_ms: float | None,
    fits: bool,
    **detail: Any,
) -> PlanRow:
    return PlanRow(
        device.name,
        device.memory_bytes,
        label,
        cost.spec.to_dict(),
        cost.params,
        cost.training_macs * cost.batch,
        int(memory),
        step_ms,
        fits,
        detail,
    )


def largest_fitting(
    specs: Sequence[SubmodelSpec],
    memory_bytes: int,
    batch: int,
    *,
    momentum: bool = True,
    device: DeviceBudget | None = None,
) -> int | None:
    """Index in `specs` of the costliest member whose estimated training memory (and step time) fits."""
    best: tuple[int, int] | None = None
    for k, spec in enumerate(specs):
        cost = estimate(spec, batch, momentum=momentum)
        step = device.step_ms(cost.training_macs * batch) if device is not None else None
        ok = cost.training_bytes <= memory_bytes
        if ok and device is not None and device.step_ms_budget is not None and step is not None:
            ok = step <= device.step_ms_budget
        if ok and (best is None or cost.training_bytes > best[1]):
            best = (k, cost.training_bytes)
    return None if best is None else best[0]


def member_for_budget(
    specs: Sequence[SubmodelSpec], memory_bytes: int, batch: int, *, momentum: bool = True
) -> int:
    """What strategies call at assignment: the largest member that fits, else the cheapest one."""
    k = largest_fitting(specs, memory_bytes, batch, momentum=momentum)
    if k is not None:
        return k
    return min(range(len(specs)), key=lambda i: estimate(specs[i], batch, momentum=momentum).training_bytes)


def device_memory_budget(memory_budget_bytes: int | None, profile: dict[str, Any] | None) -> int | None:
    """A registered device's memory budget: given explicitly, or recorded in its profile, else unknown."""
    if memory_budget_bytes is not None:
        return int(memory_budget_bytes)
    budget = ((profile or {}).get("budget") or {}).get("memory_bytes")
    return None if budget is None else int(budget)


def plan_family(
    labels: Sequence[str],
    specs: Sequence[SubmodelSpec],
    devices: Sequence[DeviceBudget],
    batch: int,
    *,
    momentum: bool = True,
) -> list[PlanRow]:
    """NeFL / HeteroFL / FjORD: each device gets the largest member that fits (the smallest, flagged, if none)."""
    rows = []
    smallest = min(
        range(len(specs)), key=lambda k: estimate(specs[k], batch, momentum=momentum).training_bytes
    )
    for device in devices:
        k = largest_fitting(specs, device.memory_bytes, batch, momentum=momentum, device=device)
        chosen = smallest if k is None else k
        cost = estimate(specs[chosen], batch, momentum=momentum)
        rows.append(
            _row(
                device,
                labels[chosen],
                cost,
                cost.training_bytes,
                device.step_ms(cost.training_macs * batch),
                k is not None,
                member=chosen,
            )
        )
    return rows


def kmeans_1d(values: Sequence[float], k: int, iterations: int = 100) -> tuple[list[float], list[int]]:
    """Lloyd's k-means on scalars, seeded at evenly spaced quantiles (deterministic); centres ascending."""
    data = np.asarray(values, dtype=float)
    k = max(1, min(k, len(np.unique(data))))
    centres = np.quantile(data, (np.arange(k) + 0.5) / k)
    labels = np.zeros(len(data), dtype=int)
    for _ in range(iterations):
        labels = np.argmin(np.abs(data[:, None] - centres[None, :]), axis=1)
        updated = np.array(
            [data[labels == j].mean() if np.any(labels == j) else centres[j] for j in range(k)]
        )
        if np.allclose(updated, centres):
            break
        centres = updated
    order = np.argsort(centres)
    rank = np.empty(k, dtype=int)
    rank[order] = np.arange(k)
    return [float(c) for c in centres[order]], [int(rank[j]) for j in labels]


def cluster_budget_fractions(budgets: Sequence[int], levels: int, full_bytes: int) -> list[float]:
    """ScaleFL §6.a.1: k-means of the fleet's budgets into L clusters; r_l = min budget in cluster / full cost.

    The full model is always the top level (ScaleFL's level L), whether or not a device can hold it."""
    _, labels = kmeans_1d([float(b) for b in budgets], levels)
    fractions = set()
    for cluster in set(labels):
        smallest = min(b for b, lab in zip(budgets, labels) if lab == cluster)
        if smallest < full_bytes:
            fractions.add(round(smallest / full_bytes, 6))
    return [*sorted(fractions), 1.0]


def assign_levels(
    level_specs: Sequence[SubmodelSpec], devices: Sequence[DeviceBudget], batch: int, *, momentum: bool = True
) -> list[PlanRow]:
    """Each device takes the largest level whose estimated training memory fits (§6.b invariant 7)."""
    labels = [f"L{level + 1}" for level in range(len(level_specs))]
    return plan_family(labels, level_specs, devices, batch, momentum=momentum)


@dataclass(frozen=True)
class MemoryLevel:
    """One ScaleFL complexity level found with training memory as the cost (METHODS §6.a.1 allows RAM)."""

    width: float
    depth: int
    memory_bytes: int
    target_bytes: int


def scalefl_memory_levels(
    model: ModelConfig,
    targets: Sequence[int],
    batch: int,
    *,
    tolerance: float = 0.05,
    step: float = 0.02,
    momentum: bool = True,
) -> list[MemoryLevel]:
    """ScaleFL's split rule (§6.a.2) with cost = estimated training memory: per target, ascending, the most
    balanced (s_w, s_d) among the splits under the target that come within ε of the best one reachable
    (channel counts are coarse, so the window is relative to what fits, not to the target); each level
    ends at a later block than the previous one and keeps the earlier levels' exits. A target nothing
    fits under is dropped (its devices fall back to a lower level)."""
    blocks = len(block_infos(model.arch, model.image_size, model.extra))
    widths = [round(step * i, 6) for i in range(1, round(1 / step) + 1)]
    levels: list[MemoryLevel] = []
    for target in sorted(targets):
        exits = tuple(level.depth - 1 for level in levels)
        # Memory only grows with width (the linear scan this replaces stopped at the first width over the
        # target), so per depth the fitting widths are a prefix and the eligible ones a run at its end: both
        # ends are found by bisection, and only the widths that can win are estimated (2-3x fewer estimates;
        # tests/profiler/test_planner.py holds the choice equal to the full scan's).
        sweeps = [
            _WidthSweep(model.with_(exit_points=(*exits, depth - 1)), depth, widths, batch, momentum)
            for depth in range((levels[-1].depth if levels else 0) + 1, blocks + 1)
        ]
        fitting = [(sweep, sweep.count_at_most(target)) for sweep in sweeps]
        fitting = [(sweep, count) for sweep, count in fitting if count > 0]
        if not fitting:
            continue
        reach = max(sweep.memory(count - 1) for sweep, count in fitting)
        candidates: list[MemoryLevel] = []
        for sweep, count in fitting:
            first = sweep.first_at_least((1 - tolerance) * reach, count)
            if first == count:
                continue
            ratio = sweep.depth / blocks
            nearest = min(abs(widths[i] - ratio) for i in range(first, count))
            for i in range(first, count):  # in the scan's order, so exact ties resolve as it did
                if abs(widths[i] - ratio) == nearest:
                    candidates.append(MemoryLevel(widths[i], sweep.depth, sweep.memory(i), int(target)))
        levels.append(min(candidates, key=lambda lv: (abs(lv.width - lv.depth / blocks), -lv.memory_bytes)))
    return levels


class _WidthSweep:
    """One depth's submodels across the width grid, each estimated at most once (memory grows with width)."""

    def __init__(
        self, model: ModelConfig, depth: int, widths: list[float], batch: int, momentum: bool
    ) -> None:
        self.model, self.depth, self.widths, self.batch, self.momentum = model, depth, widths, batch, momentum
        self._memory: dict[int, int] = {}

    def memory(self, index: int) -> int:
        if index not in self._memory:
            spec = SubmodelSpec(
                self.model,
                width=self.widths[index],
                depth=self.depth,
                exits=self.model.exit_points,
                head=False,
            )
            self._memory[index] = estimate(spec, self.batch, momentum=self.momentum).training_bytes
        return self._memory[index]

    def count_at_most(self, limit: float) -> int:
        """How many of the grid's widths, from the narrowest, need at most `limit` bytes."""
        low, high = 0, len(self.widths)
        while low < high:
            middle = (low + high) // 2
            if self.memory(middle) <= limit:
                low = middle + 1
            else:
                high = middle
        return low

    def first_at_least(self, floor: float, end: int) -> int:
        """The narrowest width index below `end` that needs at least `floor` bytes (`end` if none does)."""
        low, high = 0, end
        while low < high:
            middle = (low + high) // 2
            if self.memory(middle) >= floor:
                high = middle
            else:
                low = middle + 1
        return low


def scalefl_level_specs(model: ModelConfig, levels: Sequence[MemoryLevel]) -> list[SubmodelSpec]:
    """Submodel of each level (exits of all lower levels kept) plus the full model on top (level L)."""
    config = model.with_(exit_points=tuple(level.depth - 1 for level in levels))
    specs = [
        SubmodelSpec(
            config, width=level.width, depth=level.depth, exits=config.exit_points[: i + 1], head=False
        )
        for i, level in enumerate(levels)
    ]
    return [*specs, SubmodelSpec(config, exits=config.exit_points)]


def plan_depthwise(
    costs: DepthCosts,
    full_cost: ModelCost,
    devices: Sequence[DeviceBudget],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    plan_of: Callable[[int], tuple[StagePlan, int]] | None = None,
    stem_every_stage: bool = False,
) -> list[PlanRow]:
    """FeDepth: each device's greedy stages (§3.a.2) — or `plan_of(budget)` → (plan, models) from the
    strategy; memory = its costliest stage, time = its slowest stage step."""
    plan_of = plan_of or (lambda budget: (costs.plan(budget, tolerance), 1))
    rows = []
    blocks = {p.index: p for p in full_cost.parts if p.kind == "block" and p.index is not None}
    stem, head = full_cost.part("stem"), full_cost.part("head")
    for device in devices:
        try:
            plan, m = plan_of(device.memory_bytes)
        except ConfigError as exc:
            rows.append(
                PlanRow(
                    device.name,
                    device.memory_bytes,
                    "does not fit",
                    None,
                    full_cost.params,
                    0,
                    0,
                    None,
                    False,
                    {"reason": str(exc)},
                )
            )
            continue
        stage_bytes = [m * b for b in costs.stage_bytes(plan, stem_every_stage)]
        stage_macs = []
        for j, stage in enumerate(plan.stages):
            first = stage[0] if stage else len(plan.bypass)
            frozen = sum(blocks[b].forward_macs for b in blocks if b < first and b not in plan.bypass)
            trained = sum(blocks[b].training_macs for b in stage) + head.training_macs
            stem_macs = stem.training_macs if j == 0 or stem_every_stage else stem.forward_macs
            stage_macs.append(m * (trained + frozen + stem_macs))
        slowest = max(stage_macs) * full_cost.batch
        step = device.step_ms(slowest)
        rows.append(
            _row(
                device,
                plan.describe() + (f" ×{m} models" if m > 1 else ""),
                full_cost,
                max(stage_bytes),
                step,
                device.allows(max(stage_bytes), step, tolerance),
                plan=plan.to_dict(),
                models=m,
                stage_bytes=[int(b) for b in stage_bytes],
            )
        )
    return rows


def plan_to_json(method: str, rows: Sequence[PlanRow], batch: int, **extra: Any) -> dict[str, Any]:
    return {
        "schema": "nestling.plan/1",
        "method": method,
        "batch": batch,
        **extra,
        "devices": [r.to_dict() for r in rows],
    }


__all__ = [
    "DeviceBudget",
    "PlanRow",
    "StagePlan",
    "assign_levels",
    "cluster_budget_fractions",
    "device_memory_budget",
    "kmeans_1d",
    "largest_fitting",
    "member_for_budget",
    "plan_depthwise",
    "plan_family",
    "plan_to_json",
    "scalefl_level_specs",
    "scalefl_memory_levels",
]
