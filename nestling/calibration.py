"""A submodel ready to predict, exactly as the server evaluates it and export reproduces it.

Static BN (sBN, HeteroFL's evaluation rule) lives here because both the server's evaluation and a board's
export need it: models trained with batch statistics hold no running statistics, so they are calibrated over
training data first. Per-width BN (FjORD) selects the target's width.
"""

from __future__ import annotations

import torch

from nestling.eval_target import EvalTarget
from nestling.models.layers import Scaler, SlimBatchNorm2d, set_active_width
from nestling.models.net import ScalableNet
from nestling.models.zoo import build
from nestling.spec import SubmodelSpec


def calibration_subset(x: torch.Tensor, samples: int, seed: int) -> torch.Tensor:
    """`samples` training images drawn without replacement by `seed` (all of them for 0 or more than held).

    sBN over all of CIFAR-10's 50,000 images for each of five widths costs more than the round it scores."""
    if samples <= 0 or samples >= len(x):
        return x
    generator = torch.Generator().manual_seed(seed)
    return x[torch.randperm(len(x), generator=generator)[:samples]]


@torch.no_grad()
def static_bn(
    model: ScalableNet, calibration: torch.Tensor, *, batch_size: int = 512, device: str = "cpu"
) -> None:
    """sBN: one pass over the training data with cumulative averaging (momentum=None), weights untouched."""
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
    for start in range(0, len(calibration), batch_size):
        model(calibration[start : start + batch_size].to(device))


def model_for_target(
    target: EvalTarget,
    *,
    device: str = "cpu",
    calibration: torch.Tensor | None = None,
    batch_size: int = 512,
) -> ScalableNet:
    """Build the target's network, load its weights, select its width and (sBN targets) calibrate it."""
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
    model.to(device)
    if target.active_width is not None:
        set_active_width(model, target.active_width)
    if target.static_bn:
        if calibration is None:
            raise ValueError("static BN evaluation needs calibration (training) data")
        static_bn(model, calibration, batch_size=batch_size, device=device)
    return model
