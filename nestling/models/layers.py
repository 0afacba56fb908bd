"""Width-slimmable layers: physically sliced at build time, optionally narrowed again at run time.

Every layer remembers the channel count of the *global* model so that a run-time width p
(FjORD's ordered dropout, METHODS §7.2) keeps exactly ceil(C_global·p) channels, the same rule
that `build(spec)` applied when the module was made (METHODS §1.1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nestling.models.roles import LAYER_NORM, NORM, declare_role, own_tensor_names


def kept_channels(global_channels: int, ratio: float, rounding: str = "ceil") -> int:
    """Channels kept out of `global_channels` at width `ratio` (METHODS §1.1; ScaleFL floors)."""
    if ratio >= 1.0:
        return global_channels
    product = global_channels * ratio
    # Guard against float noise such as 64*0.75000000001: round to 9 decimals before ceil/floor.
    product = round(product, 9)
    count = math.ceil(product) if rounding == "ceil" else math.floor(product)
    return max(1, min(global_channels, count))


class SlimConv2d(nn.Conv2d):
    """Conv2d that can run on a prefix of its output channels and on whatever input it is given."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        *,
        global_out: int,
        stride: int = 1,
        padding: int = 0,
        groups: int = 1,
        bias: bool = False,
        rounding: str = "ceil",
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, groups=groups, bias=bias)
        self.global_out = global_out
        self.rounding = rounding
        self.depthwise = groups > 1 and groups == in_channels == out_channels
        self.active_out: int | None = None

    def set_active_width(self, ratio: float | None) -> None:
        self.active_out = (
            None
            if ratio is None
            else min(self.out_channels, kept_channels(self.global_out, ratio, self.rounding))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n_in = x.shape[1]
        n_out = self.active_out if self.active_out is not None else self.out_channels
        if self.depthwise:
            n_out = n_in
        if n_out == self.out_channels and (n_in == self.in_channels):
            return super().forward(x)
        if self.depthwise:
            weight = self.weight[:n_in]
            groups = n_in
        else:
            weight = self.weight[:n_out, :n_in]
            groups = 1
        bias = self.bias[:n_out] if self.bias is not None else None
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, groups)


class SlimLinear(nn.Linear):
    """Linear layer; its output is sliced only when `slim_out` (hidden layers), never for class logits."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        global_out: int,
        slim_out: bool,
        bias: bool = True,
        rounding: str = "ceil",
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.global_out = global_out
        self.slim_out = slim_out
        self.rounding = rounding
        self.active_out: int | None = None

    def set_active_width(self, ratio: float | None) -> None:
        if self.slim_out and ratio is not None:
            self.active_out = min(self.out_features, kept_channels(self.global_out, ratio, self.rounding))
        else:
            self.active_out = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n_in = x.shape[-1]
        n_out = self.active_out if self.active_out is not None else self.out_features
        if n_in == self.in_features and n_out == self.out_features:
            return super().forward(x)
        bias = self.bias[:n_out] if self.bias is not None else None
        return F.linear(x, self.weight[:n_out, :n_in], bias)


RUNNING_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def is_running_statistic(key: str) -> bool:
    """A BN running statistic or counter (also the per-width `running_mean_w{j}` / `running_var_w{j}`):
    state measured from data, not a trained weight, so it moves by its own rules (a never-trained submodel's
    statistics jump from their initial values on its first update)."""
    name = key.rsplit(".", 1)[-1]
    return name in RUNNING_STATISTICS or name.startswith(("running_mean_w", "running_var_w"))


def is_running_variance(key: str) -> bool:
    """A BN running variance (never negative in an honest model)."""
    name = key.rsplit(".", 1)[-1]
    return name == "running_var" or name.startswith("running_var_w")


class SlimBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm over a channel prefix, with the statistics policy each method needs (METHODS §1.3).

    stats="running": ordinary running statistics; "batch": batch statistics always (HeteroFL/ScaleFL/
    FeDepth local training); "per_width": one running-statistics set per width level with a shared
    affine (FjORD), buffers `running_mean_w{j}` / `running_var_w{j}` for every level this module holds.
    """

    def __init__(
        self,
        num_features: int,
        *,
        global_features: int,
        stats: str = "running",
        width_levels: tuple[float, ...] = (),
        max_ratio: float = 1.0,
        rounding: str = "ceil",
    ) -> None:
        track = stats == "running"
        super().__init__(num_features, track_running_stats=track)
        self.global_features = global_features
        self.stats = stats
        self.rounding = rounding
        self.width_levels = tuple(width_levels)
        self.active_level: int | None = None
        self.active_features: int | None = None
        if stats == "per_width":
            for j, level in enumerate(self.width_levels):
                if level <= max_ratio + 1e-9:
                    n = kept_channels(global_features, level, rounding)
                    self.register_buffer(f"running_mean_w{j}", torch.zeros(n))
                    self.register_buffer(f"running_var_w{j}", torch.ones(n))
        declare_role(self, NORM, *own_tensor_names(self))  # affine and statistics: per-submodel in NeFL

    def set_active_width(self, ratio: float | None) -> None:
        if ratio is None:
            self.active_features = None
            self.active_level = None
            return
        self.active_features = min(
            self.num_features, kept_channels(self.global_features, ratio, self.rounding)
        )
        if self.stats == "per_width":
            self.active_level = self._level_of(ratio)

    def _level_of(self, ratio: float) -> int:
        for j, level in enumerate(self.width_levels):
            if abs(level - ratio) < 1e-6:
                return j
        raise ValueError(f"width {ratio} is not one of the per-width BN levels {self.width_levels}")

    def _default_level(self) -> int:
        held = [j for j in range(len(self.width_levels)) if hasattr(self, f"running_mean_w{j}")]
        return max(held)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        weight = self.weight[:n] if self.weight is not None else None
        bias = self.bias[:n] if self.bias is not None else None
        if self.stats == "per_width":
            level = self.active_level if self.active_level is not None else self._default_level()
            mean = getattr(self, f"running_mean_w{level}")
            var = getattr(self, f"running_var_w{level}")
            # Per-width statistics use a fixed momentum (FjORD): a cumulative average has no per-width counter.
            assert self.momentum is not None, "per-width BN statistics need a momentum"
            return F.batch_norm(x, mean, var, weight, bias, self.training, self.momentum, self.eps)
        if self.stats == "batch" or not self.track_running_stats:
            return F.batch_norm(x, None, None, weight, bias, True, 0.0, self.eps)
        if n == self.num_features:
            return super().forward(x)
        assert (
            self.running_mean is not None
            and self.running_var is not None
            and self.num_batches_tracked is not None
        )
        mean = self.running_mean[:n]
        var = self.running_var[:n]
        if self.training:
            # Prefix views: in-place updates of the running stats land in the module's own buffers.
            self.num_batches_tracked.add_(1)
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        return F.batch_norm(x, mean, var, weight, bias, self.training, momentum, self.eps)


class SlimLayerNorm(nn.LayerNorm):
    """LayerNorm over a feature prefix (ViT width scaling)."""

    def __init__(self, features: int, *, global_features: int) -> None:
        super().__init__(features)
        self.global_features = global_features
        declare_role(self, LAYER_NORM, *own_tensor_names(self))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        if n == self.normalized_shape[0]:
            return super().forward(x)
        return F.layer_norm(x, (n,), self.weight[:n], self.bias[:n], self.eps)


class Scaler(nn.Module):
    """Divide activations by the width ratio (HeteroFL: training only; ScaleFL: always)."""

    def __init__(self, ratio: float, mode: str) -> None:
        super().__init__()
        self.ratio = ratio
        self.mode = mode  # "none" | "train" | "always"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "none" or self.ratio >= 1.0:
            return x
        if self.mode == "train" and not self.training:
            return x
        return x / self.ratio


def set_active_width(module: nn.Module, ratio: float | None) -> None:
    """Narrow every slimmable layer of `module` to width `ratio` (None restores the built width)."""
    for layer in module.modules():
        if isinstance(layer, (SlimConv2d, SlimLinear, SlimBatchNorm2d)):
            layer.set_active_width(ratio)
