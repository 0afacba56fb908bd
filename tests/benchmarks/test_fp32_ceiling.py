"""The fp32 roofline counts ResNet-20's convolutions and their FLOPs right."""

from __future__ import annotations

from benchmarks.fp32_ceiling import ConvCall, record_convolutions


def test_resnet20_makes_21_convolutions_and_only_the_stem_needs_no_input_gradient() -> None:
    calls = record_convolutions(batch=2)
    assert len(calls) == 21  # stem + 9 blocks x 2 + 2 projection shortcuts
    assert [c.needs_input_grad for c in calls] == [False] + [True] * 20
    assert calls[0].input_shape == (2, 3, 32, 32) and calls[0].weight_shape == (16, 3, 3, 3)


def test_flops_follow_the_output_size_and_stride() -> None:
    same = ConvCall((32, 16, 32, 32), (16, 16, 3, 3), (1, 1), (1, 1), True)
    assert same.flops() == 2 * 32 * 32 * 32 * 16 * 16 * 9
    strided = ConvCall((32, 16, 32, 32), (32, 16, 3, 3), (2, 2), (1, 1), True)
    assert strided.flops() == 2 * 32 * 16 * 16 * 32 * 16 * 9
