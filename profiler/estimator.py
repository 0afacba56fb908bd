"""Per-part parameters, MACs, saved-activation bytes and training memory of any submodel, without data.

The figures come from running the submodel itself on data-less tensors (profiler/trace.py): what autograd
keeps for backward is recorded by storage, exactly as the measured profile counts it (profiler/measure.py),
so a storage kept by two ops or two parts counts once. A spec is traced once (about a tenth of a second);
every batch and every later call is arithmetic on the cached trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from nestling.errors import ConfigError
from nestling.profiler.trace import trace
from nestling.spec import SubmodelSpec

FLOAT = 4


@dataclass(frozen=True)
class PartCost:
    """Estimate for one part (stem, block i, exit i or head) at one batch size."""

    name: str
    kind: str
    index: int | None
    params: int
    trainable_params: int
    param_bytes: int  # parameters + buffers
    forward_macs: int  # per sample
    activation_bytes: int  # what autograd keeps for backward during this part (its saved input included)
    momentum: bool
    input_shared_bytes: int = (
        0  # of those, kept by the part that produced the input too (counted there as well)
    )

    @property
    def training_macs(self) -> int:
        """Forward + backward ≈ 3× forward (input and weight gradients each cost about one forward)."""
        return 3 * self.forward_macs

    @property
    def grads_bytes(self) -> int:
        return FLOAT * self.trainable_params

    @property
    def optimizer_bytes(self) -> int:
        return FLOAT * self.trainable_params if self.momentum else 0

    @property
    def training_bytes(self) -> int:
        return self.param_bytes + self.grads_bytes + self.optimizer_bytes + self.activation_bytes


@dataclass(frozen=True)
class ModelCost:
    """Estimate for a whole submodel: its parts plus totals (activations counted once across parts)."""

    spec: SubmodelSpec
    batch: int
    parts: tuple[PartCost, ...]
    activation_bytes: int

    @property
    def params(self) -> int:
        return sum(p.params for p in self.parts)

    @property
    def forward_macs(self) -> int:
        return sum(p.forward_macs for p in self.parts)

    @property
    def training_macs(self) -> int:
        return 3 * self.forward_macs

    @property
    def param_bytes(self) -> int:
        return sum(p.param_bytes for p in self.parts)

    @property
    def grads_bytes(self) -> int:
        return sum(p.grads_bytes for p in self.parts)

    @property
    def optimizer_bytes(self) -> int:
        return sum(p.optimizer_bytes for p in self.parts)

    @property
    def training_bytes(self) -> int:
        """Peak training memory model: weights, gradients, momentum and every saved activation at once."""
        return self.param_bytes + self.grads_bytes + self.optimizer_bytes + self.activation_bytes

    def part(self, name: str) -> PartCost:
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(f"no part '{name}' in {[p.name for p in self.parts]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec_id": self.spec.id,
            "batch": self.batch,
            "params": self.params,
            "forward_macs": self.forward_macs,
            "training_macs": self.training_macs,
            "activation_bytes": self.activation_bytes,
            "training_bytes": self.training_bytes,
            "parts": [
                {
                    "name": p.name,
                    "params": p.params,
                    "forward_macs": p.forward_macs,
                    "activation_bytes": p.activation_bytes,
                    "training_bytes": p.training_bytes,
                }
                for p in self.parts
            ],
        }


@lru_cache(maxsize=8192)
def estimate(spec: SubmodelSpec, batch: int = 32, *, momentum: bool = True) -> ModelCost:
    """Estimate training `spec` at `batch` with SGD (momentum buffers when `momentum`)."""
    if batch < 1:
        raise ConfigError(f"batch must be >= 1, got {batch}")
    traced = trace(spec)
    parts = []
    source: str | None = None
    for r in traced.parts:
        shared = traced.shared_bytes(source, r.name, batch) if source else 0
        parts.append(
            PartCost(
                r.name,
                r.kind,
                r.index,
                r.params,
                r.trainable,
                r.param_bytes,
                r.macs,
                traced.part_bytes(r.name, batch),
                momentum,
                shared,
            )
        )
        if r.kind in ("stem", "block"):
            source = r.name  # exits and the head do not feed later parts
    return ModelCost(spec, batch, tuple(parts), traced.total_bytes(batch))


def training_memory(spec: SubmodelSpec, batch: int = 32, *, momentum: bool = True) -> int:
    """Bytes to train `spec` at `batch`: the figure budgets are compared with."""
    return estimate(spec, batch, momentum=momentum).training_bytes
