"""Argument checks shared by the partitioners, so every impossible request fails the same clear way."""

from __future__ import annotations

from typing import Any

import numpy as np

from nestling.errors import ConfigError


def as_labels(labels: Any) -> np.ndarray:
    """Labels as a 1-D int64 array (numpy arrays, lists and CPU tensors all accepted)."""
    array = np.asarray(labels)
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise ConfigError(
            f"[partition] labels must be a non-empty 1-D integer array, got {array.dtype} {array.shape}"
        )
    if array.min() < 0:
        raise ConfigError(f"[partition] labels must be >= 0, found {int(array.min())}")
    return array.astype(np.int64, copy=False)


def check_clients(num_clients: Any, n_samples: int) -> None:
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise ConfigError(f"[partition] num_clients must be a positive integer, got {num_clients!r}")
    if num_clients > n_samples:
        raise ConfigError(f"[partition] {num_clients} clients cannot share {n_samples} samples")


def check_alpha(alpha: Any) -> None:
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, (int, float, np.integer, np.floating))
        or not np.isfinite(alpha)
        or alpha <= 0
    ):
        raise ConfigError(f"[partition] Dirichlet alpha must be a finite number > 0, got {alpha!r}")
