"""Classifier heads: the final head and the exit heads that can follow any block (METHODS §1.5, §6.a.4, §7.3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nestling.models.context import BuildContext


class PoolClassifier(nn.Module):
    """[BN [→ ReLU] →] global average pool → linear. Post-activation ResNets skip the norm; FeDepth's
    auxiliary heads (METHODS §3.a.8) skip the ReLU."""

    def __init__(
        self, ctx: BuildContext, global_channels: int, *, with_norm: bool, relu: bool = True
    ) -> None:
        super().__init__()
        self.scale = ctx.scaler() if with_norm else None  # HeteroFL: a Scaler in front of every norm
        self.norm = ctx.norm(global_channels) if with_norm else None
        self.relu = relu
        self.fc = ctx.classifier(global_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(self.scale(x) if self.scale is not None else x)
            x = F.relu(x) if self.relu else x
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ScaleFLExit(nn.Module):
    """ScaleFL exit: 3 × [conv3×3 C→C → Scaler → BN → ReLU] → GAP → linear (METHODS §6.a.4)."""

    def __init__(self, ctx: BuildContext, global_channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(3):
            layers += [
                ctx.conv(global_channels, global_channels, 3),
                ctx.scaler(),
                ctx.norm(global_channels),
                nn.ReLU(),
            ]
        self.body = nn.Sequential(*layers)
        self.fc = ctx.classifier(global_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.body(x), 1), 1))


class SepConv(nn.Module):
    """depthwise 3×3 (stride s) → 1×1 → BN → ReLU → depthwise 3×3 → 1×1 → BN → ReLU (DepthFL heads)."""

    def __init__(self, ctx: BuildContext, global_in: int, global_out: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            ctx.conv(global_in, global_in, 3, stride=stride, depthwise=True),
            ctx.conv(global_in, global_in, 1),
            ctx.norm(global_in),
            nn.ReLU(),
            ctx.conv(global_in, global_in, 3, depthwise=True),
            ctx.conv(global_in, global_out, 1),
            ctx.norm(global_out),
            nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class DepthFLExit(nn.Module):
    """DepthFL exit (METHODS §7.3): sigmoid attention gate, then SepConvs doubling channels to the last stage."""

    def __init__(self, ctx: BuildContext, global_channels: int, final_channels: int) -> None:
        super().__init__()
        self.attention = nn.Sequential(
            SepConv(ctx, global_channels, global_channels, 2), nn.Upsample(scale_factor=2), nn.Sigmoid()
        )
        stack: list[nn.Module] = []
        channels = global_channels
        while channels < final_channels:
            stack.append(SepConv(ctx, channels, channels * 2, 2))
            channels *= 2
        self.stack = nn.Sequential(*stack)
        self.fc = ctx.classifier(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.attention(x)
        if gate.shape[-2:] != x.shape[-2:]:  # odd spatial sizes: the upsampled gate may be one pixel larger
            gate = gate[..., : x.shape[-2], : x.shape[-1]]
        feature = self.stack(gate * x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(feature, 1), 1))


class TokenClassifier(nn.Module):
    """ViT head: LayerNorm → class token → linear."""

    def __init__(self, ctx: BuildContext, dim: int) -> None:
        super().__init__()
        self.norm = ctx.layer_norm(dim)
        self.fc = ctx.classifier(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x)[:, 0])


def make_exit(ctx: BuildContext, global_channels: int, final_channels: int, *, preact: bool) -> nn.Module:
    """The exit head of the model config's `exit_kind` for a block emitting `global_channels`."""
    kind = ctx.model.exit_kind
    if kind == "scalefl":
        return ScaleFLExit(ctx, global_channels)
    if kind == "depthfl":
        return DepthFLExit(ctx, global_channels, final_channels)
    return PoolClassifier(ctx, global_channels, with_norm=True, relu=kind != "fedepth")
