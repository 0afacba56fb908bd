"""Shared fixtures for the data tests: one torch thread (the machine is shared) and small CIFAR-like arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def tiny_cifar() -> dict[str, np.ndarray]:
    """60 train / 20 test random 32x32 RGB images (NHWC uint8) with every one of 10 classes present."""
    rng = np.random.default_rng(7)
    return {
        "train_x": rng.integers(0, 256, size=(60, 32, 32, 3), dtype=np.uint8),
        "train_y": np.arange(60) % 10,
        "test_x": rng.integers(0, 256, size=(20, 32, 32, 3), dtype=np.uint8),
        "test_y": np.arange(20) % 10,
    }
