"""Clocks the coordinator reads (wall for a real fleet, virtual for replay) and predicted task durations."""

from __future__ import annotations

from nestling.profiler.traces import DeviceTrace
from nestling.server.clock import Clock, VirtualClock, WallClock

__all__ = ["Clock", "VirtualClock", "WallClock", "task_duration"]


def task_duration(
    trace: DeviceTrace,
    train_flops: float,
    bytes_down: int,
    bytes_up: int,
    *,
    model: str | None = None,
    samples: int | None = None,
) -> float:
    """Predicted wall time of one task on this device: download, train, upload, plus one latency each way."""
    return (
        trace.compute_seconds(train_flops, model=model, samples=samples)
        + trace.transfer_seconds(bytes_up, bytes_down)
        + 2.0 * trace.latency_s
    )
