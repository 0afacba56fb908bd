"""BuildContext: turns global channel counts into the sliced layers of one submodel."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from nestling.models.config import ModelConfig
from nestling.models.layers import (
    Scaler,
    SlimBatchNorm2d,
    SlimConv2d,
    SlimLayerNorm,
    SlimLinear,
    kept_channels,
)


@dataclass(frozen=True)
class BuildContext:
    """Everything a layer constructor needs: the model config and the width being built."""

    model: ModelConfig
    width: float

    def channels(self, global_channels: int, ratio: float | None = None) -> int:
        return kept_channels(global_channels, self.width if ratio is None else ratio, self.model.rounding)

    def conv(
        self,
        global_in: int,
        global_out: int,
        kernel: int,
        *,
        stride: int = 1,
        in_ratio: float | None = None,
        out_ratio: float | None = None,
        image_input: bool = False,
        depthwise: bool = False,
    ) -> SlimConv2d:
        n_in = global_in if image_input else self.channels(global_in, in_ratio)
        n_out = self.channels(global_out, out_ratio)
        if depthwise:
            return SlimConv2d(
                n_out,
                n_out,
                kernel,
                global_out=global_out,
                stride=stride,
                padding=kernel // 2,
                groups=n_out,
                rounding=self.model.rounding,
            )
        return SlimConv2d(
            n_in,
            n_out,
            kernel,
            global_out=global_out,
            stride=stride,
            padding=kernel // 2,
            rounding=self.model.rounding,
        )

    def norm(self, global_features: int, ratio: float | None = None) -> SlimBatchNorm2d:
        r = self.width if ratio is None else ratio
        return SlimBatchNorm2d(
            self.channels(global_features, ratio),
            global_features=global_features,
            stats=self.model.norm_stats,
            width_levels=self.model.width_levels,
            max_ratio=r,
            rounding=self.model.rounding,
        )

    def layer_norm(self, global_features: int) -> SlimLayerNorm:
        return SlimLayerNorm(self.channels(global_features), global_features=global_features)

    def linear(
        self,
        global_in: int,
        global_out: int,
        *,
        slim_out: bool,
        in_ratio: float | None = None,
        out_ratio: float | None = None,
        bias: bool = True,
    ) -> SlimLinear:
        n_in = self.channels(global_in, in_ratio)
        n_out = self.channels(global_out, out_ratio) if slim_out else global_out
        return SlimLinear(
            n_in, n_out, global_out=global_out, slim_out=slim_out, bias=bias, rounding=self.model.rounding
        )

    def classifier(self, global_in: int) -> SlimLinear:
        """Class logits: every class row kept, inputs sliced (METHODS §1.1)."""
        return self.linear(global_in, self.model.num_classes, slim_out=False)

    def scaler(self, ratio: float | None = None) -> nn.Module:
        return Scaler(self.width if ratio is None else ratio, self.model.scaler)
