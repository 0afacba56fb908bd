"""The PyTorch reference of an export: the submodel in eval mode exactly as the server evaluates it.

Models trained with batch statistics (norm_stats="batch": HeteroFL, ScaleFL, FeDepth) hold no running
statistics. Exporting them with batch statistics would make a prediction depend on the rest of its
batch (and be undefined at batch 1), so export *calibrates* them instead: static BN (sBN, HeteroFL's
own evaluation rule) over a sample of training data, the same pass the server's evaluation runs
(nestling.calibration).
"""

from __future__ import annotations

from dataclasses import replace

import torch

import nestling.methods  # noqa: F401  (the methods' exit heads register before a model is built)
from nestling.calibration import model_for_target
from nestling.errors import ConfigError
from nestling.eval_target import EvalTarget
from nestling.models.net import ScalableNet


def needs_calibration(target: EvalTarget) -> bool:
    return target.static_bn or target.spec.model.norm_stats == "batch"


def reference_model(
    target: EvalTarget, calibration: torch.Tensor | None = None, batch_size: int = 256
) -> ScalableNet:
    """Build, load and (if needed) sBN-calibrate the target's ScalableNet; returned in eval mode on CPU."""
    if needs_calibration(target):
        if calibration is None or len(calibration) == 0:
            raise ConfigError(
                f"{target.name} uses batch statistics ({target.spec.model.norm_stats}); exporting it "
                "needs calibration data for static BN: pass --calib-data DATASET"
            )
        target = replace(target, static_bn=True)
    model = model_for_target(target, device="cpu", calibration=calibration, batch_size=batch_size)
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model
