"""augment_batch: a vectorised random crop with padding plus horizontal flip, checked against brute force."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nestling.data import augment_batch
from nestling.errors import ConfigError


def find_crop(
    original: torch.Tensor, augmented: torch.Tensor, fill: float = 0.0
) -> tuple[int, int, bool] | None:
    """Which (top, left, flipped) window of the 4-padded image equals `augmented`, if any."""
    _, h, w = original.shape
    padded = F.pad(original, (4, 4, 4, 4), value=fill)
    for top in range(9):
        for left in range(9):
            window = padded[:, top : top + h, left : left + w]
            if torch.equal(window, augmented):
                return top, left, False
            if torch.equal(window.flip(-1), augmented):
                return top, left, True
    return None


def test_none_is_identity() -> None:
    x = torch.randn(5, 3, 8, 8)
    assert augment_batch(x, "none", torch.Generator().manual_seed(0)) is x


def test_cifar_keeps_shape_and_every_image_is_a_padded_crop_or_its_flip() -> None:
    x = torch.randn(64, 3, 12, 10)  # non-square on purpose: rows and columns must not be swapped
    out = augment_batch(x, "cifar", torch.Generator().manual_seed(0))
    assert out.shape == x.shape and out.dtype == x.dtype
    found = [find_crop(x[i], out[i]) for i in range(len(x))]
    assert all(f is not None for f in found)
    tops = {f[0] for f in found}
    lefts = {f[1] for f in found}
    flips = [f[2] for f in found]
    assert len(tops) >= 6 and len(lefts) >= 6  # offsets spread over 0..8
    assert 16 <= sum(flips) <= 48  # about half flipped
    assert not torch.equal(out, x)


def test_cifar_is_reproducible_for_a_generator_seed() -> None:
    x = torch.randn(16, 3, 8, 8)
    first = augment_batch(x, "cifar", torch.Generator().manual_seed(42))
    again = augment_batch(x, "cifar", torch.Generator().manual_seed(42))
    other = augment_batch(x, "cifar", torch.Generator().manual_seed(43))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_fill_pads_with_the_given_per_channel_value() -> None:
    x = torch.zeros(200, 2, 6, 6)
    fill = torch.tensor([-2.0, 3.0])
    out = augment_batch(x, "cifar", torch.Generator().manual_seed(1), fill=fill)
    assert set(out[:, 0].unique().tolist()) == {-2.0, 0.0}
    assert set(out[:, 1].unique().tolist()) == {0.0, 3.0}
    with pytest.raises(ConfigError, match=r"one value or one per channel"):
        augment_batch(x, "cifar", torch.Generator(), fill=torch.zeros(3))


def test_unknown_kind_and_bad_shape_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"unknown augmentation 'autoaugment' \(known: cifar, none\)"):
        augment_batch(torch.zeros(1, 3, 8, 8), "autoaugment", torch.Generator())
    with pytest.raises(ConfigError, match=r"\(N,C,H,W\)"):
        augment_batch(torch.zeros(3, 8, 8), "cifar", torch.Generator())
