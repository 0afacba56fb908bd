"""Static BN calibration data: a seeded subset of the training images, or all of them."""

from __future__ import annotations

import torch

from nestling.calibration import calibration_subset, static_bn
from nestling.models.config import ModelConfig
from nestling.models.layers import SlimBatchNorm2d
from nestling.models.zoo import build
from nestling.spec import SubmodelSpec


def test_a_subset_is_distinct_seeded_rows_and_zero_means_all() -> None:
    x = torch.arange(1000, dtype=torch.float32).reshape(1000, 1)
    subset = calibration_subset(x, 100, seed=3)
    assert subset.shape == (100, 1) and len(set(subset[:, 0].tolist())) == 100
    assert torch.equal(subset, calibration_subset(x, 100, seed=3))
    assert not torch.equal(subset, calibration_subset(x, 100, seed=4))
    assert calibration_subset(x, 0, seed=3) is x and calibration_subset(x, 5000, seed=3) is x


def test_static_bn_on_a_subset_estimates_the_full_statistics() -> None:
    torch.manual_seed(0)
    model = build(
        SubmodelSpec(
            ModelConfig("tinycnn", num_classes=10, in_channels=1, image_size=8, norm_stats="running")
        )
    )
    x = torch.randn(4000, 1, 8, 8) * 2.0 + 0.5

    def statistics() -> dict[str, torch.Tensor]:
        return {
            f"{name}.{stat}": getattr(module, stat).clone()
            for name, module in model.named_modules()
            if isinstance(module, SlimBatchNorm2d)
            for stat in ("running_mean", "running_var")
        }

    static_bn(model, x)
    full = statistics()
    static_bn(model, calibration_subset(x, 1000, seed=0))
    sub = statistics()
    assert full and full.keys() == sub.keys()
    for key, value in full.items():  # a quarter of the data: means and variances within a few percent
        assert torch.allclose(sub[key], value, rtol=0.1, atol=0.05), key
