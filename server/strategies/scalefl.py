"""ScaleFL (Ilhan et al., CVPR 2023): width × depth levels with early exits and self-distillation (METHODS §6)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from nestling.errors import ConfigError
from nestling.models.config import ModelConfig
from nestling.models.zoo import block_infos
from nestling.profiler.estimator import estimate
from nestling.profiler.planner import (
    assign_levels,
    cluster_budget_fractions,
    scalefl_level_specs,
    scalefl_memory_levels,
)
from nestling.server.strategies.base import DeviceInfo, EvalTarget, StrategyContext
from nestling.server.strategies.options import MethodOptions
from nestling.server.strategies.planning import FleetPlan, Plannable, PlanRequest
from nestling.server.strategies.registry import register_strategy
from nestling.server.strategies.scalefl_split import Level, explicit_levels, search_levels
from nestling.server.strategies.submodel import SubmodelStrategy
from nestling.spec import SubmodelSpec


@dataclass(frozen=True)
class ScaleFLOptions(MethodOptions):
    levels: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0)  # parameter-count fractions, rising to 1.0
    kd_gamma: float = 0.0
    kd_temperature: float = 3.0
    tolerance: float = 0.05
    # [[width, depth], ...] below the full model (`nestling plan --method scalefl` prints them), instead of the
    # search over `levels`; checked by scalefl_split.explicit_levels
    grid: tuple[Any, ...] | None = None
    # "shuffled": equal shares of a seeded permutation of the client indices (the reference setting); "blocks":
    # contiguous equal blocks by index, smallest level first, as NeFL, FjORD, DepthFL and HeteroFL (`order =
    # "listed"`) give their tiers, so a comparison puts every method's tier k on the same clients
    assign: str = "shuffled"


@register_strategy
class ScaleFL(Plannable, SubmodelStrategy):
    """Level l keeps blocks [0, d_l) at width s_w,l, exits 1..l; levels come from the grid search over
    parameter-count fractions (`levels`), or are given (`grid`, e.g. from `nestling plan --method scalefl`).

    Level assignment: fixed shares over a seeded permutation of client indices (the reference setting);
    the planner may instead assign by measured budgets. Aggregation counts only tensors that received a
    gradient (the trainer drops untouched ones from the upload)."""

    name = "scalefl"
    planning: ClassVar[str] = "levels"
    procedure = "scalefl-sd"
    partial_uploads = True
    options_type: ClassVar[type[MethodOptions]] = ScaleFLOptions
    options: ScaleFLOptions

    @staticmethod
    def family_model(ctx: StrategyContext) -> ModelConfig:
        """ScaleFL's model family: ScaleFL exits, Scaler, batch statistics, floor rounding (no exits yet)."""
        return ctx.model_config(exit_kind="scalefl", scaler="always", norm_stats="batch", rounding="floor")

    def make_model_config(self) -> ModelConfig:
        base = self.family_model(self.ctx)
        num_blocks = len(block_infos(base.arch, base.image_size, base.extra))
        self.levels: list[Level]
        if self.options.grid is not None:
            self.levels = explicit_levels(self.options.grid, num_blocks=num_blocks)
        else:
            fractions = self.options.levels
            if not fractions or fractions[-1] != 1.0 or sorted(fractions) != list(fractions):
                raise ConfigError(f"[method] ScaleFL levels must rise to 1.0, got {list(fractions)}")
            self.levels = search_levels(
                base, fractions, num_blocks=num_blocks, tolerance=self.options.tolerance
            )
        return base.with_(exit_points=tuple(level.depth - 1 for level in self.levels[:-1]))

    @classmethod
    def plan_fleet(cls, request: PlanRequest) -> FleetPlan:
        """k-means of the budgets into levels (§6.a.1), a memory-cost split per level, the largest fitting level
        for each device; the facts say how to train exactly these levels (`--set method.grid=...`)."""
        context = StrategyContext(
            arch=request.arch,
            num_classes=request.classes,
            in_channels=request.shape[0],
            image_size=request.shape[1],
            num_clients=1,
            total_rounds=1,
        )
        base, batch = cls.family_model(context), request.batch
        full = estimate(SubmodelSpec(base), batch).training_bytes
        fractions = cluster_budget_fractions([d.memory_bytes for d in request.devices], request.levels, full)[
            :-1
        ]
        found = scalefl_memory_levels(
            base, [int(f * full) for f in fractions], batch, tolerance=request.tolerance
        )
        specs = scalefl_level_specs(base, found)
        levels = [
            {
                "width": lv.width,
                "depth": lv.depth,
                "memory_bytes": lv.memory_bytes,
                "target_bytes": lv.target_bytes,
            }
            for lv in found
        ]
        top = {"width": 1.0, "depth": None, "memory_bytes": estimate(specs[-1], batch).training_bytes}
        facts = {
            "levels": [*levels, {**top, "target_bytes": full}],
            "strategy_options": {"grid": [[lv.width, lv.depth] for lv in found]},
        }
        return FleetPlan(assign_levels(specs, request.devices, batch), facts)

    def setup(self) -> None:
        self.specs: list[SubmodelSpec] = []
        for position, level in enumerate(self.levels):
            last = position == len(self.levels) - 1
            exits = self.model.exit_points[: position + (0 if last else 1)]
            self.specs.append(
                SubmodelSpec(
                    self.model, width=level.width, depth=None if last else level.depth, exits=exits, head=last
                )
            )
        if self.options.assign not in ("shuffled", "blocks"):
            raise ConfigError(
                f"[method] ScaleFL assign must be 'shuffled' or 'blocks', got '{self.options.assign}'"
            )
        order = (
            np.random.default_rng(self.ctx.seed).permutation(self.ctx.num_clients)
            if self.options.assign == "shuffled"
            else np.arange(self.ctx.num_clients)
        )
        self.level_of_index = {
            int(i): min(len(self.specs) - 1, pos * len(self.specs) // self.ctx.num_clients)
            for pos, i in enumerate(order)
        }

    def spec_for(self, round_index: int, device: DeviceInfo) -> SubmodelSpec:
        fitted = self.fit_by_budget(device, self.specs)
        if fitted is not None:  # a registered budget: the largest level that fits it (§6.a.1)
            return self.specs[fitted]
        return self.specs[self.level_of_index.get(device.index % self.ctx.num_clients, 0)]

    def local_hparams(self, round_index: int, device: DeviceInfo, spec: SubmodelSpec) -> dict[str, Any]:
        hp = super().local_hparams(round_index, device, spec)
        hp.update(kd_gamma=self.options.kd_gamma, kd_temperature=self.options.kd_temperature)
        return hp

    def eval_targets(self) -> list[EvalTarget]:
        return [
            EvalTarget(f"L{n}", spec, self.task_weights(spec)) for n, spec in enumerate(self.specs, start=1)
        ]
