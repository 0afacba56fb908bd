"""ScaleFL's exit head (METHODS §6.a.4): three conv-BN-ReLU layers before the pool, exit_kind "scalefl"."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nestling.models.context import BuildContext
from nestling.models.heads import ExitHead, ExportKit, register_exit_head


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


@register_exit_head("scalefl")
class ScaleFLExitHead(ExitHead):
    """Builds ScaleFLExit; export folds its body's conv → Scaler → BN runs into single convolutions."""

    def build(
        self, ctx: BuildContext, global_channels: int, final_channels: int, *, preact: bool
    ) -> nn.Module:
        return ScaleFLExit(ctx, global_channels)

    def standalone(self, part: nn.Module, kit: ExportKit) -> nn.Module | None:
        if not isinstance(part, ScaleFLExit):
            return None
        return kit.PoolLinear(nn.Sequential(*kit.fold_chain(list(part.body))), kit.plain_linear(part.fc))
