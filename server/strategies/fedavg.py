"""FedAvg (McMahan et al. 2017): every device trains the same model; data-weighted mean of all tensors."""

from __future__ import annotations

from typing import Any, ClassVar

from nestling.messages import Result
from nestling.server.strategies.base import DeviceInfo, EvalTarget, Strategy
from nestling.server.strategies.registry import register_strategy
from nestling.spec import SubmodelSpec


@register_strategy
class FedAvg(Strategy):
    """`width` < 1 gives the "FedAvg ×r" baseline: the whole fleet trains the model every board can hold."""

    name = "fedavg"
    option_defaults: ClassVar[dict[str, Any]] = {"width": 1.0}

    def setup(self) -> None:
        self.spec = SubmodelSpec(self.model, width=float(self.options["width"]))

    def spec_for(self, round_index: int, device: DeviceInfo) -> SubmodelSpec:
        return self.spec

    def aggregation_weight(self, result: Result) -> float:
        return float(result.num_samples)

    def eval_targets(self) -> list[EvalTarget]:
        label = "full" if self.spec.width == 1.0 else f"w{self.spec.width:g}"
        return [EvalTarget(label, self.spec, self.task_weights(self.spec))]
