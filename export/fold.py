"""Folding arithmetic: BatchNorm, NeFL step sizes and Scaler constants merged into plain convolutions.

Every fold is computed in float64 and stored as float32, so a folded layer differs from the unfolded
chain by one float32 rounding, not by the accumulated error of several.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nestling.errors import SpecError
from nestling.models.layers import Scaler, SlimBatchNorm2d

Affine = tuple[torch.Tensor, torch.Tensor]  # per-channel (scale, shift): y = scale·x + shift, float64


def inference_stats(bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and variance this BatchNorm normalises with in eval mode (FjORD: its active width's level)."""
    if isinstance(bn, SlimBatchNorm2d) and bn.stats == "per_width":
        level = bn.active_level if bn.active_level is not None else bn._default_level()
        return getattr(bn, f"running_mean_w{level}"), getattr(bn, f"running_var_w{level}")
    if bn.running_mean is None or bn.running_var is None:
        raise SpecError(
            "a BatchNorm that uses batch statistics has no running statistics to fold; "
            "calibrate it first (static BN, see docs/export.md)"
        )
    return bn.running_mean, bn.running_var


def bn_affine(bn: nn.BatchNorm2d, input_scale: float = 1.0) -> Affine:
    """Eval-mode BN of (input_scale·x) as y = a·x + b per channel: a = f·γ/√(σ²+ε), b = β − γμ/√(σ²+ε).

    `input_scale` is the Scaler constant f between a convolution and its BN (ScaleFL's 1/ρ).
    """
    if isinstance(bn, SlimBatchNorm2d) and bn.active_features not in (None, bn.num_features):
        raise SpecError(
            "a BatchNorm narrowed below its built width cannot be exported; build the spec at that width"
        )
    mean, var = (t.detach().double() for t in inference_stats(bn))
    n = mean.numel()
    gamma = bn.weight.detach().double()[:n] if bn.weight is not None else torch.ones(n, dtype=torch.float64)
    beta = bn.bias.detach().double()[:n] if bn.bias is not None else torch.zeros(n, dtype=torch.float64)
    scale = gamma / torch.sqrt(var + bn.eps)
    return scale * input_scale, beta - scale * mean


def scale_affine(affine: Affine, factor: float | torch.Tensor) -> Affine:
    """s·(a·x + b) = (s·a)·x + s·b — how a NeFL step size s folds into the normalisation before it."""
    scale, shift = affine
    factor = torch.as_tensor(factor, dtype=torch.float64).reshape(-1)
    return scale * factor, shift * factor


def scaler_factor(module: nn.Module) -> float:
    """The constant a Scaler multiplies by in eval mode (ScaleFL: 1/ρ always; HeteroFL: 1 at inference)."""
    if not isinstance(module, Scaler):
        return 1.0
    if module.mode == "always" and module.ratio < 1.0:
        return 1.0 / module.ratio
    return 1.0


def conv_like(conv: nn.Conv2d, in_channels: int, out_channels: int, *, groups: int, bias: bool) -> nn.Conv2d:
    """A new plain Conv2d with `conv`'s kernel size, stride, padding and dilation."""
    geometry: dict[str, Any] = {
        "kernel_size": conv.kernel_size,
        "stride": conv.stride,
        "padding": conv.padding,
        "dilation": conv.dilation,
    }
    return nn.Conv2d(in_channels, out_channels, groups=groups, bias=bias, **geometry)


def fold_conv(conv: nn.Conv2d, *, pre_scale: float = 1.0, post: Affine | None = None) -> nn.Conv2d:
    """A plain Conv2d computing post(conv(pre_scale · x)): weights W·a·pre_scale, bias a·bias + b."""
    if conv.groups > 1 and conv.groups != conv.in_channels:
        raise SpecError("only dense and depthwise convolutions can be folded")
    if getattr(conv, "active_out", None) not in (None, conv.out_channels):
        raise SpecError(
            "a convolution narrowed below its built width cannot be exported; build the spec at that width"
        )
    weight = conv.weight.detach().double() * pre_scale
    bias = conv.bias.detach().double() if conv.bias is not None else None
    if post is not None:
        scale, shift = post
        weight = weight * scale.view(-1, 1, 1, 1)
        if bias is not None:
            bias = scale * bias + shift
        elif bool(shift.ne(0).any()):
            bias = shift
    out = conv_like(conv, conv.in_channels, conv.out_channels, groups=conv.groups, bias=bias is not None)
    with torch.no_grad():
        out.weight.copy_(weight.float())
        if bias is not None and out.bias is not None:
            out.bias.copy_(bias.float())
    return out


def plain_linear(linear: nn.Linear, *, scale: float | torch.Tensor = 1.0) -> nn.Linear:
    """A plain nn.Linear computing scale·linear(x) (a ViT step size folded into its projection)."""
    factor = torch.as_tensor(scale, dtype=torch.float64)
    out = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    with torch.no_grad():
        out.weight.copy_((linear.weight.detach().double() * factor).float())
        if linear.bias is not None and out.bias is not None:
            out.bias.copy_((linear.bias.detach().double() * factor).float())
    return out


class ChannelAffine(nn.Module):
    """y = a·x + b per channel: an eval-mode BN that cannot fold into a convolution (pre-activation)."""

    scale: torch.Tensor
    shift: torch.Tensor

    def __init__(self, affine: Affine) -> None:
        super().__init__()
        scale, shift = affine
        self.register_buffer("scale", scale.float().view(1, -1, 1, 1))
        self.register_buffer("shift", shift.float().view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift
