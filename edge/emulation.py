"""Make a real agent on a fast machine behave like a slower board: pad compute, pace transfers.

`nestling agent --emulate CLASS` wraps training and transfers with an `EmulatedDevice` so that a
loopback MQTT fleet replays a trace in wall-clock time with the durations the simulator predicts.
The cost model lives here, once: the simulator's duration model (simulator/durations.py) uses the
same `samples_trained`, `MacCounter`, `training_flops` and `payload_bytes`, so an emulated agent
pads to exactly what a replay predicts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from nestling.messages import Result, Task
from nestling.models.cost import count_macs
from nestling.models.zoo import build
from nestling.spec import SubmodelSpec

ANY_MODEL = "*"  # block_latency_s key that applies to every model (FedScale's latencies are model-free)
FLOPS_PER_MAC = 2.0
TRAIN_OVER_FORWARD = 3.0  # forward + backward ≈ 3 × forward (FedScale's convention, docs/devices.md)


def training_flops(forward_macs: float, samples: int) -> float:
    """FLOPs of training `samples` samples on a model of `forward_macs` MACs per sample."""
    return forward_macs * FLOPS_PER_MAC * TRAIN_OVER_FORWARD * samples


def samples_trained(hparams: Mapping[str, Any], num_samples: int) -> int:
    """Samples one task pushes through the model, exactly as edge.procedures.common.batches draws them.

    `local_steps` steps, else `local_epochs` × ⌈n / batch⌉ steps, over reshuffled passes of the data
    whose last batch is the remainder (dropped when it holds a single sample: BatchNorm needs two).
    So epochs × n when the remainder is not 1, and steps × batch only when batch divides n."""
    n = int(num_samples)
    if n <= 0:
        return 0
    batch = max(1, min(int(hparams.get("batch_size", 32)), n))
    steps = hparams.get("local_steps")
    total = int(steps) if steps is not None else int(hparams.get("local_epochs", 1)) * -(-n // batch)
    sizes = [batch] * (n // batch)
    remainder = n % batch
    if remainder >= 2 or (remainder and n < 2):
        sizes.append(remainder)
    passes, rest = divmod(max(0, total), len(sizes))
    return passes * sum(sizes) + sum(sizes[:rest])


def payload_bytes(tensors: Mapping[str, Any]) -> int:
    """Bytes of the tensors a task or result carries (the wire adds headers: well under 1 % here)."""
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


class MacCounter:
    """Forward MACs per spec, counted once each (building a submodel costs far more than a lookup)."""

    def __init__(self, input_shape: tuple[int, ...]) -> None:
        self.input_shape = tuple(input_shape)
        self._macs: dict[str, int] = {}

    def __call__(self, spec: SubmodelSpec) -> int:
        if spec.id not in self._macs:
            self._macs[spec.id] = count_macs(build(spec, init=False), self.input_shape)  # type: ignore[arg-type]
        return self._macs[spec.id]


def task_training_flops(task: Task, num_samples: int, macs: MacCounter) -> float:
    """FLOPs of training `task` on a device holding `num_samples` samples (the replay's figure too)."""
    return training_flops(macs(SubmodelSpec.from_dict(task.spec)), samples_trained(task.hparams, num_samples))


class DeviceSpeed(Protocol):
    """The figures emulation needs; simulator.catalogue.BoardClass and SpeedFigures both have them."""

    @property
    def sustained_gflops(self) -> float | None: ...

    @property
    def up_bps(self) -> float: ...

    @property
    def down_bps(self) -> float: ...

    @property
    def latency_s(self) -> float: ...


def measured_compute_seconds(
    block_latency_s: Mapping[str, float] | None, spec: SubmodelSpec, samples: int, macs: MacCounter
) -> float | None:
    """Training time from a measured per-sample latency of the *full* model (a trace's `block_latency_s`,
    keyed by model or ANY_MODEL): a submodel costs its share of the full model's MACs. None when the
    device has no latency for this model (then FLOPs over its sustained speed apply)."""
    latencies = block_latency_s or {}
    per_sample = latencies.get(spec.model.arch, latencies.get(ANY_MODEL))
    if per_sample is None:
        return None
    return float(per_sample) * samples * macs(spec) / macs(SubmodelSpec.full(spec.model))


@dataclass(frozen=True)
class SpeedFigures:
    """Explicit figures, e.g. one device of a trace (gflops, up_bps, down_bps, latency_s fields, and
    measured per-sample training latencies where the trace has them)."""

    sustained_gflops: float | None
    up_bps: float
    down_bps: float
    latency_s: float = 0.0
    block_latency_s: Mapping[str, float] | None = None  # {model or "*": seconds per training sample}

    @classmethod
    def from_trace(cls, trace: Any) -> SpeedFigures:
        """One device of a trace (simulator.traces.DeviceTrace): gflops, measured latencies, or both."""
        if trace.gflops is None and not trace.block_latency_s:
            raise ValueError(
                f"trace device '{trace.device_id}' has neither gflops nor block_latency_s: nothing to pad compute to"
            )
        return cls(
            trace.gflops,
            trace.up_bps,
            trace.down_bps,
            trace.latency_s,
            dict(trace.block_latency_s) if trace.block_latency_s else None,
        )

    def __post_init__(self) -> None:
        for name in ("up_bps", "down_bps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.sustained_gflops is None and not self.block_latency_s:
            raise ValueError("sustained_gflops is needed unless block_latency_s gives measured latencies")
        if self.sustained_gflops is not None and not self.sustained_gflops > 0:
            raise ValueError(f"sustained_gflops must be > 0, got {self.sustained_gflops!r}")
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s!r}")
        for model, seconds in (self.block_latency_s or {}).items():
            if not (isinstance(seconds, (int, float)) and seconds > 0):
                raise ValueError(
                    f"block_latency_s[{model!r}] must be > 0 seconds per sample, got {seconds!r}"
                )


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

    @classmethod
    def of_board(cls, board: Any) -> EmulationTarget:
        """A catalogue class (simulator.catalogue.BoardClass)."""
        return cls(
            board.name, SpeedFigures(board.sustained_gflops, board.up_bps, board.down_bps, board.latency_s)
        )

    @classmethod
    def of_trace(cls, trace: Any) -> EmulationTarget:
        """One device of a trace (simulator.traces.DeviceTrace) with its own sampled figures."""
        return cls(trace.device_class, SpeedFigures.from_trace(trace), trace.device_id)

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
        )
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
