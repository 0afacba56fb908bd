"""Calibration batches of real, normalised images: one iterator feeds ORT int8 and TensorRT int8 alike."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from nestling.errors import DataError


class CalibrationBatches:
    """Fixed-size float32 NCHW batches over a calibration sample, re-iterable.

    Every batch has exactly `batch_size` samples (TensorRT calibrators bind one fixed shape), so a
    trailing partial batch is dropped; `limit` caps how many samples are used at all.
    """

    def __init__(self, x: np.ndarray, batch_size: int = 32, limit: int | None = None) -> None:
        x = np.asarray(x)
        if x.ndim != 4:
            raise DataError(f"calibration data must be (N, C, H, W), got shape {x.shape}")
        if batch_size < 1:
            raise DataError(f"calibration batch size must be >= 1, got {batch_size}")
        if limit is not None:
            x = x[:limit]
        if len(x) < batch_size:
            raise DataError(
                f"calibration needs at least one full batch of {batch_size} samples, got {len(x)}"
            )
        if not np.isfinite(x).all():
            raise DataError("calibration data contains NaN or Inf")
        self.x = np.ascontiguousarray(x, dtype=np.float32)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return len(self.x) // self.batch_size

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of every batch."""
        return (self.batch_size, *self.x.shape[1:])

    @property
    def samples(self) -> int:
        return len(self) * self.batch_size

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self.x[i * self.batch_size : (i + 1) * self.batch_size]
