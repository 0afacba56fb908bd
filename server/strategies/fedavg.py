"""FedAvg (McMahan et al. 2017): every device trains the same model; data-weighted mean of all tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nestling.messages import Result
from nestling.server.strategies.base import DeviceInfo, EvalTarget
from nestling.server.strategies.options import MethodOptions
from nestling.server.strategies.registry import register_strategy
from nestling.server.strategies.submodel import SubmodelStrategy
from nestling.spec import SubmodelSpec


@dataclass(frozen=True)
class FedAvgOptions(MethodOptions):
    width: float = 1.0  # < 1: the "FedAvg ×r" baseline


@register_strategy
class FedAvg(SubmodelStrategy):
    """`width` < 1 gives the "FedAvg ×r" baseline: the whole fleet trains the model every board can hold."""

    name = "fedavg"
    options_type: ClassVar[type[MethodOptions]] = FedAvgOptions
    options: FedAvgOptions

    def setup(self) -> None:
        self.spec = SubmodelSpec(self.model, width=self.options.width)

    def spec_for(self, round_index: int, device: DeviceInfo) -> SubmodelSpec:
        return self.spec

    def aggregation_weight(self, result: Result) -> float:
        return float(result.num_samples)

    def eval_targets(self) -> list[EvalTarget]:
        label = "full" if self.spec.width == 1.0 else f"w{self.spec.width:g}"
        return [EvalTarget(label, self.spec, self.task_weights(self.spec))]
