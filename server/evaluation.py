"""Evaluate each submodel a strategy reports on the test set (with sBN / per-width BN where the method needs it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nestling.calibration import model_for_target
from nestling.eval_target import EvalTarget
from nestling.models.cost import count_macs, count_parameters
from nestling.models.net import ScalableNet


@dataclass
class EvalResult:
    name: str
    spec_id: str
    accuracy: float
    loss: float
    parameters: int
    macs: int


TargetRunner = Callable[[list[EvalTarget]], list[EvalResult]]


class Evaluator:
    """Scores submodels on held-out tensors; `calibration` is training data for HeteroFL's static BN.

    `runner` scores several targets elsewhere (the simulator's worker processes, one target each) with an
    evaluator built from the same data; scoring one target stays here."""

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        batch_size: int = 512,
        device: str = "cpu",
        calibration: torch.Tensor | None = None,
        runner: TargetRunner | None = None,
    ) -> None:
        self.x, self.y = x, y
        self.runner = runner
        self.batch_size = batch_size
        self.device = device
        self.calibration = calibration
        self._cost_cache: dict[str, tuple[int, int]] = {}

    def model_for(self, target: EvalTarget) -> ScalableNet:
        """The target as it is scored: built, loaded, width selected and (sBN) calibrated (nestling.calibration)."""
        return model_for_target(
            target, device=self.device, calibration=self.calibration, batch_size=self.batch_size
        )

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
        if self.runner is not None and len(targets) > 1:
            return self.runner(targets)
        return [self.evaluate(t) for t in targets]
