"""FeDepth's auxiliary exit head (METHODS §3.a.8): BN → pool → linear, no ReLU, exit_kind "fedepth"."""

from __future__ import annotations

from torch import nn

from nestling.models.context import BuildContext
from nestling.models.heads import ExitHead, PoolClassifier, register_exit_head


@register_exit_head("fedepth")
class FeDepthExitHead(ExitHead):
    """A PoolClassifier without the ReLU after its norm; the model family folds it like any PoolClassifier."""

    def build(
        self, ctx: BuildContext, global_channels: int, final_channels: int, *, preact: bool
    ) -> nn.Module:
        return PoolClassifier(ctx, global_channels, with_norm=True, relu=False)
