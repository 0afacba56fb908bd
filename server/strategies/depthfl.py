"""DepthFL (Kim et al., ICLR 2023): depth prefixes with per-depth classifiers and mutual distillation (METHODS §7.3)."""

from __future__ import annotations

from typing import Any, ClassVar

from nestling.models.config import ModelConfig
from nestling.models.zoo import block_infos
from nestling.spec import SubmodelSpec
from server.strategies.base import DeviceInfo, EvalTarget, Strategy


def stage_ends(arch: str, image_size: int, extra: dict | None = None) -> list[int]:
    """Index one past the last block of every stage."""
    infos = block_infos(arch, image_size, extra)
    return [b.index for a, b in zip(infos, infos[1:]) if b.stage != a.stage] + [len(infos)]


class DepthFL(Strategy):
    """Client group d ∈ 1..S (S stages) trains the stem, stages 1..d and classifiers 1..d.

    Inference of a depth-d model averages the logits of its d classifiers (the DepthFL ensemble)."""

    name = "depthfl"
    procedure = "depthfl-kd"
    option_defaults: ClassVar[dict[str, Any]] = {"kd": True, "kd_ramp_rounds": 300, "exit_kind": "depthfl"}

    def make_model_config(self) -> ModelConfig:
        ends = stage_ends(self.ctx.arch, self.ctx.image_size, self.ctx.model_extra)
        return self.ctx.model_config(exit_points=tuple(e - 1 for e in ends[:-1]), exit_kind=str(self.options["exit_kind"]))

    def setup(self) -> None:
        ends = stage_ends(self.model.arch, self.model.image_size, self.model.extra)
        self.specs: list[SubmodelSpec] = []
        for d, end in enumerate(ends, start=1):
            last = d == len(ends)
            exits = tuple(e for e in self.model.exit_points if e < end)
            self.specs.append(SubmodelSpec(self.model, depth=None if last else end, exits=exits, head=last))

    def spec_for(self, round_index: int, device: DeviceInfo) -> SubmodelSpec:
        per_group = max(1, self.ctx.num_clients / len(self.specs))
        return self.specs[min(int(device.index // per_group), len(self.specs) - 1)]

    def local_hparams(self, round_index: int, device: DeviceInfo, spec: SubmodelSpec) -> dict[str, Any]:
        hp = super().local_hparams(round_index, device, spec)
        hp.update(kd=bool(self.options["kd"]), kd_ramp_rounds=int(self.options["kd_ramp_rounds"]))
        return hp

    def eval_targets(self) -> list[EvalTarget]:
        return [EvalTarget(f"d{d}", spec, self.task_weights(spec), ensemble=True)
                for d, spec in enumerate(self.specs, start=1)]
