"""The cost model: how long a board takes to train a task and move its bytes, from published or measured figures.

One definition serves both worlds: the simulator's duration model (simulator/durations.py) and an agent
emulating a slower board (edge/emulation.py) use the same `samples_trained`, `MacCounter`, `training_flops`
and `payload_bytes`, so an emulated agent pads to exactly what a replay predicts. The figures come from the
board catalogue (profiler/catalogue.py), device traces (profiler/traces.py) or this board's own profile.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from nestling.messages import Task
from nestling.models.cost import count_macs
from nestling.models.zoo import build
from nestling.spec import SubmodelSpec

ANY_MODEL = "*"  # block_latency_s key that applies to every model (FedScale's latencies are model-free)
FLOPS_PER_MAC = 2.0
TRAIN_OVER_FORWARD = 3.0  # forward + backward ≈ 3 × forward (FedScale's convention, docs/devices.md)


def training_flops(forward_macs: float, samples: int) -> float:
    """FLOPs of training `samples` samples on a model of `forward_macs` MACs per sample."""
    return forward_macs * FLOPS_PER_MAC * TRAIN_OVER_FORWARD * samples


def steps_trained(hparams: Mapping[str, Any], num_samples: int) -> int:
    """Optimizer steps one task takes, exactly as edge.procedures.common.batches counts them: `local_steps`, else
    `local_epochs` × ⌈n / batch⌉ (a skipped single-sample batch is not counted: the count goes on into the next
    pass). Each step pays a board's fixed cost per step however few samples its batch holds."""
    n = int(num_samples)
    if n <= 0:
        return 0
    batch = max(1, min(int(hparams.get("batch_size", 32)), n))
    steps = hparams.get("local_steps")
    return max(0, int(steps) if steps is not None else int(hparams.get("local_epochs", 1)) * -(-n // batch))


def samples_trained(hparams: Mapping[str, Any], num_samples: int) -> int:
    """Samples one task pushes through the model, exactly as edge.procedures.common.batches draws them.

    `steps_trained` steps over reshuffled passes of the data whose last batch is the remainder (dropped when it
    holds a single sample: BatchNorm needs two). So epochs × n when the remainder is not 1, and steps × batch
    only when batch divides n."""
    n = int(num_samples)
    if n <= 0:
        return 0
    batch = max(1, min(int(hparams.get("batch_size", 32)), n))
    total = steps_trained(hparams, n)
    sizes = [batch] * (n // batch)
    remainder = n % batch
    if remainder >= 2 or (remainder and n < 2):
        sizes.append(remainder)
    passes, rest = divmod(total, len(sizes))
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
    """The figures emulation needs; profiler.catalogue.BoardClass and SpeedFigures both have them."""

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
        """One device of a trace (profiler.traces.DeviceTrace): gflops, measured latencies, or both."""
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
