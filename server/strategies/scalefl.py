"""ScaleFL (Ilhan et al., CVPR 2023): width × depth levels with early exits and self-distillation (METHODS §6)."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from nestling.errors import ConfigError
from nestling.models.config import ModelConfig
from nestling.models.zoo import block_infos
from nestling.server.strategies.base import DeviceInfo, EvalTarget, Strategy
from nestling.server.strategies.registry import register_strategy
from nestling.server.strategies.scalefl_split import Level, explicit_levels, search_levels
from nestling.spec import SubmodelSpec


@register_strategy
class ScaleFL(Strategy):
    """Level l keeps blocks [0, d_l) at width s_w,l, exits 1..l; levels come from the grid search over
    parameter-count fractions (`levels`), or are given (`grid`, e.g. from `nestling plan --method scalefl`).

    Level assignment: fixed shares over a seeded permutation of client indices (the reference setting);
    the planner may instead assign by measured budgets. Aggregation counts only tensors that received a
    gradient (the trainer drops untouched ones from the upload)."""

    name = "scalefl"
    planning = "levels"
    procedure = "scalefl-sd"
    partial_uploads = True
    option_defaults: ClassVar[dict[str, Any]] = {
        "levels": (0.125, 0.25, 0.5, 1.0),
        "kd_gamma": 0.0,
        "kd_temperature": 3.0,
        "tolerance": 0.05,
        "grid": None,
    }

    def make_model_config(self) -> ModelConfig:
        base = self.ctx.model_config(
            exit_kind="scalefl", scaler="always", norm_stats="batch", rounding="floor"
        )
        num_blocks = len(block_infos(base.arch, base.image_size, base.extra))
        self.levels: list[Level]
        if self.options.get("grid") is not None:
            self.levels = explicit_levels(self.options["grid"], num_blocks=num_blocks)
        else:
            fractions = tuple(float(f) for f in self.options["levels"])
            if not fractions or fractions[-1] != 1.0 or sorted(fractions) != list(fractions):
                raise ConfigError(f"[method] ScaleFL levels must rise to 1.0, got {list(fractions)}")
            self.levels = search_levels(
                base, fractions, num_blocks=num_blocks, tolerance=float(self.options["tolerance"])
            )
        return base.with_(exit_points=tuple(level.depth - 1 for level in self.levels[:-1]))

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
        order = np.random.default_rng(self.ctx.seed).permutation(self.ctx.num_clients)
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
        hp.update(
            kd_gamma=float(self.options["kd_gamma"]), kd_temperature=float(self.options["kd_temperature"])
        )
        return hp

    def eval_targets(self) -> list[EvalTarget]:
        return [
            EvalTarget(f"L{n}", spec, self.task_weights(spec)) for n, spec in enumerate(self.specs, start=1)
        ]
