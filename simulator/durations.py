"""Predicted task timings on traced devices: when a task's result reaches the server, or its device drops.

Training time of the assigned submodel = `edge.emulation.training_flops` (forward MACs counted once
per spec x 2 FLOP per MAC x 3 for forward + backward x `samples_trained`, the samples the local
procedure really draws) over the device's sustained GFLOP/s. When the trace holds a measured
per-sample latency for the model, that latency is scaled by the submodel's share of the full model's
MACs instead. Transfers use the tensor bytes the task carries down and the same slice coming back up,
each with one latency. The cost pieces live in edge/emulation.py, which an emulating agent (`nestling
agent --emulate`) paces itself with, so a loopback fleet and a replay agree by construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nestling.messages import Task
from nestling.profiler.speed import (
    MacCounter,
    measured_compute_seconds,
    payload_bytes,
    samples_trained,
    training_flops,
)
from nestling.profiler.traces import DeviceTrace
from nestling.spec import SubmodelSpec

__all__ = ["Arrival", "MacCounter", "TaskCost", "TraceDurations", "payload_bytes", "samples_trained"]


@dataclass(frozen=True)
class TaskCost:
    """The phases of one task in seconds: download (with one latency), training, upload (with one latency)."""

    down_s: float
    compute_s: float
    up_s: float

    @property
    def total_s(self) -> float:
        return self.down_s + self.compute_s + self.up_s


@dataclass(frozen=True)
class Arrival:
    """What becomes of one dispatched task: its result arrives `seconds` after dispatch, or its device
    goes offline at that moment without one (`dropped`); `cost` is the planned phases, when known."""

    seconds: float
    dropped: bool = False
    cost: TaskCost | None = None


class TraceDurations:
    """The replay's duration model: device id → trace, and each task's predicted arrival or dropout."""

    def __init__(
        self,
        traces: Mapping[str, DeviceTrace],
        num_samples: Mapping[str, int],
        input_shape: tuple[int, int, int],
    ) -> None:
        self.traces = traces
        self.num_samples = num_samples
        self.macs = MacCounter(input_shape)

    def cost(self, task: Task) -> TaskCost:
        """Compute, transfer and latency seconds of `task` on its device (availability aside)."""
        trace = self.traces[task.device_id]
        spec = SubmodelSpec.from_dict(task.spec)
        samples = samples_trained(task.hparams, self.num_samples[task.device_id])
        nbytes = payload_bytes(task.weights)
        return TaskCost(
            down_s=trace.transfer_seconds(0, nbytes) + trace.latency_s,
            compute_s=self.compute_seconds(trace, spec, samples),
            up_s=trace.transfer_seconds(nbytes, 0) + trace.latency_s,
        )

    def compute_seconds(self, trace: DeviceTrace, spec: SubmodelSpec, samples: int) -> float:
        measured = measured_compute_seconds(trace.block_latency_s, spec, samples, self.macs)
        if measured is not None:  # the same formula an emulating agent pads to
            return measured
        return trace.compute_seconds(training_flops(self.macs(spec), samples))

    def arrival(self, task: Task, now: float) -> Arrival:
        """Offline at dispatch: dropped at once. Going offline before the result is uploaded: dropped then."""
        trace = self.traces[task.device_id]
        if not trace.is_available(now):
            return Arrival(0.0, dropped=True)
        cost = self.cost(task)
        online_until = trace.available_until(now)
        if online_until < now + cost.total_s:
            return Arrival(online_until - now, dropped=True, cost=cost)
        return Arrival(cost.total_s, cost=cost)
