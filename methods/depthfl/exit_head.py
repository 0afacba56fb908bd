"""DepthFL's exit head (METHODS §7.3): a sigmoid attention gate, then separable convs to the last stage's width."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nestling.models.context import BuildContext
from nestling.models.heads import ExitHead, ExportKit, register_exit_head


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


def _layers(modules: nn.Sequential) -> list[nn.Module]:
    """The plain layer chain of a Sequential, every SepConv opened into its own layers (export folds those)."""
    flat: list[nn.Module] = []
    for module in modules:
        flat.extend(module.body if isinstance(module, SepConv) else [module])
    return flat


@register_exit_head("depthfl")
class DepthFLExitHead(ExitHead):
    """Builds DepthFLExit; export folds the gate and the stack and keeps the gate's crop (GatedPoolLinear)."""

    def build(
        self, ctx: BuildContext, global_channels: int, final_channels: int, *, preact: bool
    ) -> nn.Module:
        return DepthFLExit(ctx, global_channels, final_channels)

    def standalone(self, part: nn.Module, kit: ExportKit) -> nn.Module | None:
        if not isinstance(part, DepthFLExit):
            return None
        return kit.GatedPoolLinear(
            nn.Sequential(*kit.fold_chain(_layers(part.attention))),
            nn.Sequential(*kit.fold_chain(_layers(part.stack))),
            kit.plain_linear(part.fc),
        )
