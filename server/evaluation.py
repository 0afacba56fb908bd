"""Evaluate each submodel a strategy reports on the test set (with sBN / per-width BN where the method needs it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nestling.models.cost import count_macs, count_parameters
from nestling.models.layers import Scaler, SlimBatchNorm2d, set_active_width
from nestling.models.net import ScalableNet
from nestling.models.zoo import build
from nestling.server.strategies.base import EvalTarget
from nestling.spec import SubmodelSpec


@dataclass
class EvalResult:
    name: str
    spec_id: str
    accuracy: float
    loss: float
    parameters: int
    macs: int


class Evaluator:
    """Scores submodels on held-out tensors; `calibration` is training data for HeteroFL's static BN."""

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        batch_size: int = 512,
        device: str = "cpu",
        calibration: torch.Tensor | None = None,
    ) -> None:
        self.x, self.y = x, y
        self.batch_size = batch_size
        self.device = device
        self.calibration = calibration
        self._cost_cache: dict[str, tuple[int, int]] = {}

    def model_for(self, target: EvalTarget) -> ScalableNet:
        spec = target.spec
        if target.static_bn:
            spec = SubmodelSpec(
                spec.model.with_(norm_stats="running"),
                width=spec.width,
                blocks=spec.blocks,
                depth=spec.depth,
                exits=spec.exits,
                block_widths=spec.block_widths,
                head=spec.head,
            )
        model = build(spec, init=False)
        missing, unexpected = model.load_state_dict(target.state, strict=False)
        stray = [k for k in missing if "running_" not in k and "num_batches" not in k]
        if stray or unexpected:
            raise ValueError(
                f"evaluation weights do not match {target.name}: missing {stray[:3]}, unexpected {unexpected[:3]}"
            )
        model.to(self.device)
        if target.active_width is not None:
            set_active_width(model, target.active_width)
        if target.static_bn:
            self._static_bn(model)
        return model

    @torch.no_grad()
    def _static_bn(self, model: ScalableNet) -> None:
        """sBN: one pass over the training data with cumulative averaging (momentum=None), weights untouched."""
        if self.calibration is None:
            raise ValueError("static BN evaluation needs calibration (training) data")
        for module in model.modules():
            if isinstance(module, SlimBatchNorm2d):
                module.momentum = None
                module.reset_running_stats()
        model.train()
        for module in model.modules():
            if isinstance(module, Scaler):
                # Gather the statistics of the activations evaluation will see: a train-only Scaler is off
                # there, so it must be off here too (else eval normalises x with the stats of x / r).
                module.eval()
        for start in range(0, len(self.calibration), self.batch_size):
            model(self.calibration[start : start + self.batch_size].to(self.device))

    @torch.no_grad()
    def evaluate(self, target: EvalTarget) -> EvalResult:
        model = self.model_for(target)
        model.eval()
        correct, loss_sum = 0, 0.0
        for start in range(0, len(self.y), self.batch_size):
            x = self.x[start : start + self.batch_size].to(self.device)
            y = self.y[start : start + self.batch_size].to(self.device)
            outputs = model.forward_all(x)
            logits = torch.stack(outputs).mean(0) if target.ensemble else outputs[-1]
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
        params, macs = self._cost(target, model)
        n = max(1, len(self.y))
        return EvalResult(target.name, target.spec.id, correct / n, loss_sum / n, params, macs)

    def _cost(self, target: EvalTarget, model: ScalableNet) -> tuple[int, int]:
        key = f"{target.spec.id}/{target.active_width}"
        if key not in self._cost_cache:
            shape = tuple(self.x.shape[1:])
            self._cost_cache[key] = (count_parameters(model), count_macs(model, shape))  # type: ignore[arg-type]
        return self._cost_cache[key]

    def evaluate_all(self, targets: list[EvalTarget]) -> list[EvalResult]:
        return [self.evaluate(t) for t in targets]
