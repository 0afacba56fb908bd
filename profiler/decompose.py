"""FeDepth's memory-adaptive decomposition: greedy consecutive stages within a budget (METHODS §3.a.1–3.a.2)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nestling.errors import ConfigError
from nestling.profiler.estimator import ModelCost, estimate, training_memory
from nestling.spec import SubmodelSpec

DEFAULT_TOLERANCE = 0.05  # any τ in [0.036, 0.14) reproduces the reference's hard-coded stages (§3.a.2)

# FeDepth paper Table 1 (PreResNet-20, MB, pytorch-summary estimates): per-block training memory and
# the training memory R(r) of the ×r-width network.
PAPER_BLOCK_MB = (20.02, 20.02, 20.02, 14.05, 10.07, 10.07, 7.21, 5.28, 5.28)
PAPER_WIDTH_MB = {1 / 8: 14.51, 1 / 6: 19.34, 1 / 3: 38.68, 1 / 2: 58.02, 1.0: 116.04}


@dataclass(frozen=True)
class StagePlan:
    """Blocks trained stage by stage (stage 0 also trains the stem; it may hold the stem alone), and the
    input-side blocks bypassed because they cannot fit even alone (partial training, §3.a.5)."""

    stages: tuple[tuple[int, ...], ...]
    bypass: tuple[int, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {"stages": [list(s) for s in self.stages], "bypass": list(self.bypass)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StagePlan:
        try:
            stages = tuple(tuple(int(b) for b in stage) for stage in data["stages"])
            bypass = tuple(int(b) for b in data.get("bypass", ()))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed FeDepth stage plan {data!r}: {exc}") from None
        order = [b for stage in stages for b in stage]
        if not stages or order != sorted(order) or len(set(order)) != len(order) or set(order) & set(bypass):
            raise ConfigError(f"FeDepth stages must be disjoint, consecutive and ordered, got {data!r}")
        if bypass and order and max(bypass) > order[0]:
            raise ConfigError(f"bypassed blocks {list(bypass)} must precede every trained block")
        return cls(stages, bypass)

    def describe(self) -> str:
        parts = ["[" + ",".join(f"B{b + 1}" for b in s) + "]" if s else "[stem]" for s in self.stages]
        skipped = f" bypass {','.join(f'B{b + 1}' for b in self.bypass)}" if self.bypass else ""
        return " ".join(parts) + skipped


def greedy_stages(
    block_costs: Sequence[float],
    budget: float,
    tolerance: float = DEFAULT_TOLERANCE,
    *,
    stem_cost: float = 0.0,
    end_costs: Sequence[float] | None = None,
    shared: Sequence[float] | None = None,
    stem_every_stage: bool = False,
) -> StagePlan:
    """Consecutive blocks joined while a stage stays within budget·(1+τ) (METHODS §3.a.2).

    A stage costs its blocks, plus the stem for the first stage, plus `end_costs[e]`: the head it is
    trained through when it ends after block e−1 (e = 0: a stage holding only the stem). With zero stem
    and end costs this is exactly the METHODS rule. Blocks that cannot fit alone are bypassed; they may
    only form an input-side prefix. `shared[b]` is what block b keeps in common with its producer (the stem
    or block b−1: a post-activation block's output is kept by its ReLU and by the next conv); it is
    counted once when both sit in one stage. `stem_every_stage` (ViT, §3.a.9) charges the stem to every stage.
    """
    n = len(block_costs)
    ends = [0.0] * (n + 1) if end_costs is None else [float(c) for c in end_costs]
    if len(ends) != n + 1:
        raise ConfigError(f"end_costs needs {n + 1} entries (stem and every block), got {len(ends)}")
    overlap = [0.0] * n if shared is None else [float(c) for c in shared]
    limit = budget * (1.0 + tolerance)
    base = stem_cost if stem_every_stage else 0.0
    alone = [base + block_costs[b] + ends[b + 1] <= limit for b in range(n)]
    first = next((b for b in range(n) if alone[b]), n)
    if first == n:
        raise ConfigError(
            f"no block fits the budget {budget:.4g} (+{tolerance:.0%}); smallest needs "
            f"{min(c + e for c, e in zip(block_costs, ends[1:])):.4g}"
        )
    late = [b for b in range(first, n) if not alone[b]]
    if late:
        raise ConfigError(
            f"block {late[0]} needs {base + block_costs[late[0]] + ends[late[0] + 1]:.4g} > budget "
            f"{limit:.4g}: only an input-side prefix of blocks can be bypassed"
        )
    stages: list[tuple[int, ...]] = []
    current: list[int] = []
    cost = stem_cost
    for b in range(first, n):
        feeds = current or (not stages and b == 0)  # its producer is in the same stage
        added = block_costs[b] - (overlap[b] if feeds else 0.0)
        if cost + added + ends[b + 1] <= limit:
            current.append(b)
            cost += added
            continue
        if not current and stem_cost + ends[0] > limit:
            raise ConfigError(f"the stem needs {stem_cost + ends[0]:.4g} > budget {limit:.4g} even alone")
        stages.append(tuple(current))
        current, cost = [b], base + block_costs[b]
    stages.append(tuple(current))
    return StagePlan(tuple(stages), tuple(range(first)))


@dataclass(frozen=True)
class DepthCosts:
    """Training bytes of the stem, of each block, and of the head each possible stage end trains through
    (`ends[e]`: after block e−1, e = 0 for a stem-only stage; net of what it shares with that block when it
    reads the block's output directly); `shared[b]`: bytes block b shares with its producer."""

    stem: float
    blocks: tuple[float, ...]
    ends: tuple[float, ...]
    shared: tuple[float, ...] = ()

    def plan(
        self,
        budget: float,
        tolerance: float = DEFAULT_TOLERANCE,
        models: int = 1,
        stem_every_stage: bool = False,
    ) -> StagePlan:
        """Stages for `models` models trained side by side (m-FeDepth): each gets budget / models."""
        return greedy_stages(
            self.blocks,
            budget / models,
            tolerance,
            stem_cost=self.stem,
            end_costs=self.ends,
            shared=self.shared or None,
            stem_every_stage=stem_every_stage,
        )

    def stage_bytes(self, plan: StagePlan, stem_every_stage: bool = False) -> list[float]:
        """What each stage of `plan` costs by this table (the measured stage peak, up to allocator details)."""
        shared = self.shared or (0.0,) * len(self.blocks)
        out = []
        for j, stage in enumerate(plan.stages):
            cost = self.stem if j == 0 or stem_every_stage else 0.0
            for k, b in enumerate(stage):
                cost += self.blocks[b] - (shared[b] if k > 0 or (j == 0 and b == 0) else 0.0)
            out.append(cost + self.ends[stage[-1] + 1 if stage else 0])
        return out


def _table(
    stem: float,
    blocks: list[tuple[float, float]],
    head: tuple[float, float],
    exits: dict[int, tuple[float, float]],
) -> DepthCosts:
    """(training bytes, bytes shared with the producer) per part → cost table; linked heads share nothing."""
    ends = [head[0]] * len(blocks) + [head[0] - head[1]]
    for index, (cost, shared) in exits.items():
        ends[index + 1] = cost - shared
    return DepthCosts(stem, tuple(c for c, _ in blocks), tuple(ends), tuple(s for _, s in blocks))


def depth_costs(cost: ModelCost, *, aux_heads: bool = False) -> DepthCosts:
    """Cost table from an estimate of the full model (with every exit when stages end at their own heads)."""
    pairs = {p.name: (float(p.training_bytes), float(p.input_shared_bytes)) for p in cost.parts}
    blocks = [pairs[p.name] for p in cost.parts if p.kind == "block"]
    exits = (
        {p.index: pairs[p.name] for p in cost.parts if p.kind == "exit" and p.index is not None}
        if aux_heads
        else {}
    )
    return _table(pairs["stem"][0], blocks, pairs["head"], exits)


def depth_costs_from_profile(profile: dict[str, Any], *, aux_heads: bool = False) -> DepthCosts:
    """Cost table from a measured profile (profiler/measure.py) of the full model."""
    pairs = {
        p["name"]: (float(p["memory"]["training_bytes"]), float(p["memory"].get("input_shared_bytes", 0)))
        for p in profile["parts"]
    }
    blocks = [pairs[p["name"]] for p in profile["parts"] if p["kind"] == "block"]
    exits = (
        {int(p["index"]): pairs[p["name"]] for p in profile["parts"] if p["kind"] == "exit"}
        if aux_heads
        else {}
    )
    return _table(pairs["stem"][0], blocks, pairs["head"], exits)


def width_budget(spec: SubmodelSpec, ratio: float, batch: int, *, momentum: bool = True) -> int:
    """R(r): training memory of the ×r-width model (§3.a.1); r > 1 means r full models (R(r) = r·R(1))."""
    if ratio <= 0:
        raise ConfigError(f"budget width ratio must be > 0, got {ratio}")
    plain = SubmodelSpec(spec.model.with_(exit_points=()), width=min(1.0, ratio))
    base = training_memory(plain, batch, momentum=momentum)
    return round(base * ratio) if ratio > 1.0 else base


def full_model_costs(
    spec: SubmodelSpec, batch: int, *, momentum: bool = True, aux_heads: bool = False
) -> DepthCosts:
    return depth_costs(estimate(spec, batch, momentum=momentum), aux_heads=aux_heads)
