"""Make a real agent on a fast machine behave like a slower board: pad compute, pace transfers.

`nestling agent --emulate CLASS` wraps training and transfers with an `EmulatedDevice` so that a
loopback MQTT fleet replays a trace in wall-clock time with the durations the simulator predicts.
The cost formula lives here, once: the simulator's duration model (simulator/durations.py) uses the
same `training_flops`, so an emulated agent pads to exactly what a replay predicts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from nestling.models.cost import count_macs
from nestling.models.net import ScalableNet

FLOPS_PER_MAC = 2.0
TRAIN_OVER_FORWARD = 3.0  # forward + backward ≈ 3 × forward (FedScale's convention, docs/devices.md)


def training_flops(forward_macs: float, samples: int) -> float:
    """FLOPs of training `samples` samples on a model of `forward_macs` MACs per sample."""
    return forward_macs * FLOPS_PER_MAC * TRAIN_OVER_FORWARD * samples


def model_training_flops(model: ScalableNet, input_shape: tuple[int, int, int], samples: int) -> float:
    """What an agent passes to `pad_compute`: the FLOPs of the submodel it just trained."""
    return training_flops(count_macs(model, input_shape), samples)


class DeviceSpeed(Protocol):
    """The figures emulation needs; simulator.catalogue.BoardClass and SpeedFigures both have them."""

    @property
    def sustained_gflops(self) -> float: ...

    @property
    def up_bps(self) -> float: ...

    @property
    def down_bps(self) -> float: ...

    @property
    def latency_s(self) -> float: ...


@dataclass(frozen=True)
class SpeedFigures:
    """Explicit figures, e.g. one device of a trace (gflops, up_bps, down_bps, latency_s fields)."""

    sustained_gflops: float
    up_bps: float
    down_bps: float
    latency_s: float = 0.0

    @classmethod
    def from_trace(cls, trace: Any) -> SpeedFigures:
        """One device of a trace (simulator.traces.DeviceTrace); it needs a `gflops` speed."""
        if trace.gflops is None:
            raise ValueError(
                f"trace device '{trace.device_id}' has no gflops: emulation pads compute by FLOPs"
            )
        return cls(trace.gflops, trace.up_bps, trace.down_bps, trace.latency_s)

    def __post_init__(self) -> None:
        for name in ("sustained_gflops", "up_bps", "down_bps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s!r}")


class EmulatedDevice:
    """Slows this machine down to `board_class`: never speeds it up (overruns are counted instead)."""

    def __init__(self, board_class: DeviceSpeed, *, sleep: Callable[[float], None] = time.sleep) -> None:
        self.board = board_class
        self.sleep = sleep
        self.overrun_s = 0.0  # time this host was slower than the board it emulates

    def compute_seconds(self, train_flops: float) -> float:
        """How long the board takes for `train_flops` at its sustained speed."""
        return train_flops / (self.board.sustained_gflops * 1e9)

    def transfer_seconds(self, nbytes: int, direction: str = "up") -> float:
        """One-way latency plus the payload at the board's bandwidth in that direction."""
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        bps = self.board.up_bps if direction == "up" else self.board.down_bps
        return self.board.latency_s + 8.0 * nbytes / bps

    def pad_compute(self, measured_s: float, train_flops: float) -> float:
        """Sleep for predicted − measured training time; returns the seconds slept."""
        return self._pad(self.compute_seconds(train_flops), measured_s)

    def pace_transfer(self, nbytes: int, direction: str = "up", elapsed_s: float = 0.0) -> float:
        """Call after sending (up) or receiving (down) `nbytes`, with the time that took; sleeps the rest."""
        return self._pad(self.transfer_seconds(nbytes, direction), elapsed_s)

    def _pad(self, target_s: float, spent_s: float) -> float:
        wait = target_s - max(0.0, spent_s)
        if wait <= 0:
            self.overrun_s += -wait
            return 0.0
        self.sleep(wait)
        return wait
