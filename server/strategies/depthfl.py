"""DepthFL (Kim et al., ICLR 2023): depth prefixes with per-depth classifiers and mutual distillation (METHODS §7.3)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from nestling.aggregation import masked_mean
from nestling.messages import Result, Task
from nestling.models.config import ModelConfig
from nestling.models.layers import is_running_statistic
from nestling.models.zoo import block_infos
from nestling.server.strategies.base import DeviceInfo, EvalTarget
from nestling.server.strategies.options import MethodOptions
from nestling.server.strategies.registry import register_strategy
from nestling.server.strategies.submodel import SubmodelStrategy
from nestling.spec import SubmodelSpec


def stage_ends(arch: str, image_size: int, extra: dict | None = None) -> list[int]:
    """Index one past the last block of every stage."""
    infos = block_infos(arch, image_size, extra)
    return [b.index for a, b in itertools.pairwise(infos) if b.stage != a.stage] + [len(infos)]


@dataclass(frozen=True)
class DepthFLOptions(MethodOptions):
    kd: bool = True
    kd_ramp_rounds: int = 300
    exit_kind: str = "depthfl"
    # FedDyn with α = 0.1 as the DepthFL reference trains (METHODS §7.3: its published numbers include it);
    # feddyn_alpha = 0 turns it off (NeFL's and FeDepth's DepthFL baselines, AMBIG-20).
    feddyn_alpha: float = 0.1


@register_strategy
class DepthFL(SubmodelStrategy):
    """Client group d ∈ 1..S (S stages) trains the stem, stages 1..d and classifiers 1..d.

    Inference of a depth-d model averages the logits of its d classifiers (the DepthFL ensemble)."""

    name = "depthfl"
    procedure = "depthfl-kd"
    options_type: ClassVar[type[MethodOptions]] = DepthFLOptions
    options: DepthFLOptions

    def make_model_config(self) -> ModelConfig:
        ends = stage_ends(self.ctx.arch, self.ctx.image_size, self.ctx.model_extra)
        return self.ctx.model_config(
            exit_points=tuple(e - 1 for e in ends[:-1]), exit_kind=self.options.exit_kind
        )

    def setup(self) -> None:
        self.setup_feddyn()
        ends = stage_ends(self.model.arch, self.model.image_size, self.model.extra)
        self.specs: list[SubmodelSpec] = []
        for d, end in enumerate(ends, start=1):
            last = d == len(ends)
            exits = tuple(e for e in self.model.exit_points if e < end)
            self.specs.append(SubmodelSpec(self.model, depth=None if last else end, exits=exits, head=last))

    def spec_for(self, round_index: int, device: DeviceInfo) -> SubmodelSpec:
        # A measured profile sizes the depth (profiler/fit.py); without one, DepthFL's groups by index.
        fitted = self.fit_by_budget(device, self.specs) if self.board_of(device) is not None else None
        if fitted is not None:
            return self.specs[fitted]
        per_group = max(1, self.ctx.num_clients / len(self.specs))
        return self.specs[min(int(device.index // per_group), len(self.specs) - 1)]

    def local_hparams(self, round_index: int, device: DeviceInfo, spec: SubmodelSpec) -> dict[str, Any]:
        hp = super().local_hparams(round_index, device, spec)
        hp.update(
            kd=self.options.kd,
            kd_ramp_rounds=self.options.kd_ramp_rounds,
            feddyn_alpha=self.options.feddyn_alpha,
        )
        return hp

    def aggregate(self, round_index: int, accepted: list[tuple[Task, Result]]) -> None:
        """Count-based mean; with FedDyn, the server state h corrects the mean of trainable tensors (§7.3)."""
        alpha = self.options.feddyn_alpha
        if alpha <= 0:
            super().aggregate(round_index, accepted)
            return
        contributions = self.contributions(accepted)
        averaged = masked_mean(self.global_state, contributions)
        for key, mean in averaged.items():
            if is_running_statistic(key) or not mean.is_floating_point():  # BN statistics: plain mean
                self.global_state[key] = mean
                continue
            count = torch.zeros_like(mean)
            for c in contributions:
                if key in c.tensors:
                    count[c.regions[key]] += 1.0
            # A new h, never written in place: the divergence guard keeps the previous state by reference.
            h = self.feddyn_h.get(key, torch.zeros_like(mean))
            h = h - alpha * (count / self.ctx.num_clients) * (mean - self.global_state[key])
            self.feddyn_h[key] = h
            self.global_state[key] = mean - h / alpha

    def setup_feddyn(self) -> None:
        self.feddyn_h: dict[str, torch.Tensor] = {}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = super().state_tensors()
        tensors.update({f"feddyn_h/{k}": v for k, v in self.feddyn_h.items()})
        return tensors

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        super().load_state(tensors, meta)
        self.feddyn_h = {
            k.split("/", 1)[1]: v.clone() for k, v in tensors.items() if k.startswith("feddyn_h/")
        }

    def eval_targets(self) -> list[EvalTarget]:
        return [
            EvalTarget(f"d{d}", spec, self.task_weights(spec), ensemble=True)
            for d, spec in enumerate(self.specs, start=1)
        ]
