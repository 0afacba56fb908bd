"""Make a real agent on a fast machine behave like a slower board: pad compute, pace transfers.

`nestling agent --emulate CLASS` wraps training and transfers with an `EmulatedDevice` so that a
loopback MQTT fleet replays a trace in wall-clock time with the durations the simulator predicts.
The cost model both use is the profiler's (nestling.profiler.speed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nestling.messages import Result, Task
from nestling.profiler.speed import (
    DeviceSpeed,
    MacCounter,
    SpeedFigures,
    measured_compute_seconds,
    payload_bytes,
    samples_trained,
    task_training_flops,
)
from nestling.profiler.traces import DeviceTrace
from nestling.spec import SubmodelSpec


class EmulatedDevice:
    """Slows this machine down to `board_class`: never speeds it up (overruns are counted instead)."""

    def __init__(self, board_class: DeviceSpeed, *, sleep: Callable[[float], None] = time.sleep) -> None:
        self.board = board_class
        self.sleep = sleep
        self.overrun_s = 0.0  # time this host was slower than the board it emulates

    def compute_seconds(self, train_flops: float) -> float:
        """How long the board takes for `train_flops` at its sustained speed."""
        if self.board.sustained_gflops is None:
            raise ValueError("this board has measured latencies but no sustained GFLOP/s for this model")
        return train_flops / (self.board.sustained_gflops * 1e9)

    def transfer_seconds(self, nbytes: int, direction: str = "up") -> float:
        """One-way latency plus the payload at the board's bandwidth in that direction."""
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        bps = self.board.up_bps if direction == "up" else self.board.down_bps
        return self.board.latency_s + 8.0 * nbytes / bps

    def pace_transfer(self, nbytes: int, direction: str = "up", elapsed_s: float = 0.0) -> float:
        """Call after sending (up) or receiving (down) `nbytes`, with the time that took; sleeps the rest."""
        return self.pad_to(self.transfer_seconds(nbytes, direction), elapsed_s)

    def pad_to(self, target_s: float, spent_s: float) -> float:
        """Sleep until a phase predicted to take `target_s` has taken that long; returns the seconds slept."""
        wait = target_s - max(0.0, spent_s)
        if wait <= 0:
            self.overrun_s += -wait
            return 0.0
        self.sleep(wait)
        return wait


@dataclass(frozen=True)
class EmulationTarget:
    """The board an agent emulates: its name (a catalogue class, or a trace device's class) and figures."""

    name: str
    figures: SpeedFigures
    trace_device: str | None = None  # set when the figures come from one device of a trace
    memory_bytes: int | None = None  # the board's training memory (its profile reports it)
    # Injected slowdowns ([device] emulate_slowdown): (first round, round after the last, factor) — a board
    # that throttles or shares its CPU for a while, to watch the server re-plan it.
    slowdown: tuple[tuple[int, int, float], ...] = ()
    # `--emulate-availability`: the trace device (its clock already scaled) whose windows the agent leaves and
    # returns by (edge/emulated_availability.py); None: always online.
    availability: DeviceTrace | None = None

    @classmethod
    def of_board(cls, board: Any) -> EmulationTarget:
        """A catalogue class (profiler.catalogue.BoardClass)."""
        return cls(
            board.name,
            SpeedFigures(board.sustained_gflops, board.up_bps, board.down_bps, board.latency_s),
            memory_bytes=int(board.memory_budget_bytes),
        )

    @classmethod
    def of_trace(cls, trace: Any) -> EmulationTarget:
        """One device of a trace (profiler.traces.DeviceTrace) with its own sampled figures."""
        return cls(
            trace.device_class,
            SpeedFigures.from_trace(trace),
            trace.device_id,
            memory_bytes=int(trace.memory_budget_bytes),
        )

    def slowdown_at(self, round_index: int) -> float:
        """How much slower than its figures the board trains in this round (1 outside every slowdown)."""
        factor = 1.0
        for first, end, times in self.slowdown:
            if first <= round_index < end:
                factor *= times
        return factor

    def describe(self) -> dict[str, Any]:
        """What the agent's hello advertises (the server logs it and lists it in summary.json)."""
        figures = self.figures
        described: dict[str, Any] = {
            "class": self.name,
            "trace_device": self.trace_device,
            "gflops": figures.sustained_gflops,
            "up_bps": figures.up_bps,
            "down_bps": figures.down_bps,
            "latency_s": figures.latency_s,
        }
        if figures.block_latency_s:
            described["measured_latency_models"] = sorted(figures.block_latency_s)
        return described


@dataclass
class TaskPacing:
    """What emulation did to one task: the board's planned phases, the seconds slept, the shortfalls."""

    down_s: float = 0.0
    compute_s: float = 0.0
    up_s: float = 0.0
    slept_s: float = 0.0
    overrun_s: float = 0.0  # phases where this host was slower than the board (nothing to pad)
    measured_compute_s: float = 0.0

    def line(self, round_index: int, board: str) -> str:
        """The agent's log line for the task (benchmarks/fidelity.py reads it back)."""
        return (
            f"round {round_index}: emulating {board}: download {self.down_s:.3f}s, training {self.compute_s:.3f}s "
            f"(host {self.measured_compute_s:.3f}s), upload {self.up_s:.3f}s, slept {self.slept_s:.3f}s, "
            f"overrun {self.overrun_s:.3f}s"
        )


@dataclass
class TaskPacer:
    """Paces an agent's tasks to its emulated board, with the replay's cost model (simulator/durations.py).

    The agent calls `download` when the worker takes a task (the board's download ends `down_s` after
    the task's first chunk arrived), `compute` after training (padded to the board's compute time),
    and `upload` just before publishing the result (the board's upload of the result's tensors)."""

    target: EmulationTarget
    input_shape: tuple[int, ...]  # one sample's (channels, height, width)
    sleep: Callable[[float], Any] = time.sleep
    clock: Callable[[], float] = time.monotonic
    device: EmulatedDevice = field(init=False)
    macs: MacCounter = field(init=False)
    pacing: dict[str, TaskPacing] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.device = EmulatedDevice(self.target.figures, sleep=self.sleep)
        self.macs = MacCounter(self.input_shape)

    def _record(self, task_id: str) -> TaskPacing:
        if len(self.pacing) > 64 and task_id not in self.pacing:
            self.pacing.pop(next(iter(self.pacing)))
        return self.pacing.setdefault(task_id, TaskPacing())

    def _paced(self, record: TaskPacing, pace: Callable[[], float]) -> None:
        before = self.device.overrun_s
        record.slept_s += pace()
        record.overrun_s += self.device.overrun_s - before

    def download(self, task: Task, first_seen: float) -> TaskPacing:
        """The task's slice at the board's downlink, plus one latency, counted from its first chunk."""
        record = self._record(task.task_id)
        nbytes = payload_bytes(task.weights)
        record.down_s = self.device.transfer_seconds(nbytes, "down")
        elapsed = self.clock() - first_seen
        self._paced(record, lambda: self.device.pace_transfer(nbytes, "down", elapsed))
        return record

    def compute(self, task: Task, num_samples: int, measured_s: float) -> TaskPacing:
        """Training padded to the board: its measured per-sample latency scaled to the submodel when it
        has one for this model, else the FLOPs of the samples trained over its sustained speed."""
        record = self._record(task.task_id)
        spec = SubmodelSpec.from_dict(task.spec)
        samples = samples_trained(task.hparams, num_samples)
        measured = measured_compute_seconds(self.target.figures.block_latency_s, spec, samples, self.macs)
        target = (
            measured
            if measured is not None
            else self.device.compute_seconds(task_training_flops(task, num_samples, self.macs))
        ) * self.target.slowdown_at(task.round)
        record.compute_s, record.measured_compute_s = target, measured_s
        self._paced(record, lambda: self.device.pad_to(target, measured_s))
        return record

    def upload(self, result: Result, started: float) -> TaskPacing:
        """The result's tensors at the board's uplink, plus one latency, counted from `started`
        (the end of training: encoding the result is part of sending it)."""
        record = self._record(result.task_id)
        nbytes = payload_bytes(result.weights)
        record.up_s = self.device.transfer_seconds(nbytes, "up")
        elapsed = self.clock() - started
        self._paced(record, lambda: self.device.pace_transfer(nbytes, "up", elapsed))
        return record
