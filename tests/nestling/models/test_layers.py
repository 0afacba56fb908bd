"""Width-slimmable layers: the channel rule of METHODS §1.1 and run-time narrowing (FjORD) and the Scaler."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nestling.models.layers import Scaler, SlimBatchNorm2d, SlimConv2d, SlimLinear, kept_channels

RESNET18 = (64, 128, 256, 512)
CIFAR = (16, 32, 64)


@pytest.mark.parametrize(
    ("gamma", "expected"),
    [
        (0.2, (29, 58, 115, 229)),
        (0.4, (41, 81, 162, 324)),
        (0.6, (50, 100, 199, 397)),
        (0.8, (58, 115, 229, 458)),
        (0.34, (38, 75, 150, 299)),
    ],
)
def test_resnet18_stage_widths_follow_the_ceil_rule_at_sqrt_gamma(
    gamma: float, expected: tuple[int, ...]
) -> None:
    rho = math.sqrt(gamma)
    assert tuple(kept_channels(c, rho) for c in RESNET18) == expected


@pytest.mark.parametrize(
    ("gamma", "expected"),
    [
        (0.2, (8, 15, 29)),
        (0.4, (11, 21, 41)),
        (0.6, (13, 25, 50)),
        (0.8, (15, 29, 58)),
    ],
)
def test_cifar_resnet_stage_widths_follow_the_ceil_rule(gamma: float, expected: tuple[int, ...]) -> None:
    assert tuple(kept_channels(c, math.sqrt(gamma)) for c in CIFAR) == expected


@pytest.mark.parametrize(("s_w", "expected"), [(0.7, (11, 22, 44)), (0.75, (12, 24, 48))])
def test_scalefl_floors_the_product(s_w: float, expected: tuple[int, ...]) -> None:
    assert tuple(kept_channels(c, s_w, "floor") for c in CIFAR) == expected


def test_full_width_keeps_everything_and_tiny_width_keeps_one_channel() -> None:
    assert kept_channels(64, 1.0) == 64
    assert kept_channels(64, 1e-6) == 1
    assert kept_channels(3, 0.01, "floor") == 1


def test_float_noise_does_not_add_a_channel() -> None:
    # 64 · 0.75 is exactly 48; a ratio a hair above it from float arithmetic must not round up to 49.
    assert kept_channels(64, 0.75 + 1e-12) == 48
    assert kept_channels(16, 0.7) == 12 and kept_channels(16, 0.7, "floor") == 11


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1024), st.floats(0.01, 1.0), st.floats(0.01, 1.0), st.sampled_from(["ceil", "floor"]))
def test_kept_channels_is_monotone_in_the_ratio_so_submodels_nest(
    c: int, r1: float, r2: float, rounding: str
) -> None:
    low, high = sorted((r1, r2))
    assert 1 <= kept_channels(c, low, rounding) <= kept_channels(c, high, rounding) <= c


def test_slim_conv_runs_on_a_prefix_of_its_output_channels_with_the_same_weights() -> None:
    torch.manual_seed(0)
    conv = SlimConv2d(8, 16, 3, global_out=16, padding=1)
    x = torch.randn(2, 8, 5, 5)
    full = conv(x)
    conv.set_active_width(0.5)
    narrow = conv(x[:, :4])
    assert narrow.shape[1] == kept_channels(16, 0.5) == 8
    reference = torch.nn.functional.conv2d(x[:, :4], conv.weight[:8, :4], None, 1, 1)
    torch.testing.assert_close(narrow, reference)
    conv.set_active_width(None)
    torch.testing.assert_close(conv(x), full)


def test_slim_linear_never_slices_class_logits() -> None:
    head = SlimLinear(16, 10, global_out=10, slim_out=False)
    head.set_active_width(0.25)
    assert head(torch.randn(3, 4)).shape == (3, 10)
    hidden = SlimLinear(16, 32, global_out=32, slim_out=True)
    hidden.set_active_width(0.25)
    assert hidden(torch.randn(3, 4)).shape == (3, 8)


def test_per_width_batchnorm_holds_one_statistics_set_per_level_up_to_its_width() -> None:
    bn = SlimBatchNorm2d(
        kept_channels(10, 0.6),
        global_features=10,
        stats="per_width",
        width_levels=(0.2, 0.6, 1.0),
        max_ratio=0.6,
    )
    names = {n for n, _ in bn.named_buffers()}
    assert {"running_mean_w0", "running_mean_w1"} <= names and "running_mean_w2" not in names
    assert bn.running_mean_w0.shape == (2,) and bn.running_mean_w1.shape == (6,)
    assert bn.weight.shape == (6,)  # one shared affine of the built width, sliced per level
    bn.set_active_width(0.2)
    bn.train()
    before_w1 = bn.running_mean_w1.clone()
    bn(torch.randn(4, 2, 3, 3) + 5.0)
    assert bn.running_mean_w0.abs().sum() > 0  # level 0.2's statistics moved
    assert torch.equal(bn.running_mean_w1, before_w1)  # level 0.6's statistics did not


def test_prefix_batchnorm_updates_only_the_prefix_of_its_running_stats() -> None:
    bn = SlimBatchNorm2d(8, global_features=8)
    bn.set_active_width(0.5)
    bn.train()
    bn(torch.randn(4, 4, 3, 3) + 3.0)
    assert (bn.running_mean[:4] != 0).all()
    assert (bn.running_mean[4:] == 0).all()


def test_scaler_divides_by_the_ratio_only_where_its_mode_says() -> None:
    x = torch.ones(2, 3)
    train_only = Scaler(0.5, "train")
    train_only.train()
    torch.testing.assert_close(train_only(x), x / 0.5)
    train_only.eval()
    assert torch.equal(train_only(x), x)  # HeteroFL: inactive at evaluation
    always = Scaler(0.5, "always")
    always.eval()
    torch.testing.assert_close(always(x), x / 0.5)  # ScaleFL: train and test
    assert torch.equal(Scaler(0.5, "none")(x), x)
    assert torch.equal(Scaler(1.0, "always")(x), x)
