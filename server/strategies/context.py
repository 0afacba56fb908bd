"""What a strategy is built from and what it knows of a board: the run's resolved context and `DeviceInfo`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nestling.models.config import ModelConfig
from nestling.profiler.board_profile import BoardProfile
from nestling.schedule import LrSchedule
from nestling.task_params import TrainParams


@dataclass
class DeviceInfo:
    """A registered device as strategies see it: a stable index (tiers), data size, optional profile."""

    device_id: str
    index: int
    num_samples: int
    profile: dict[str, Any] | None = None
    memory_budget_bytes: int | None = None
    labels: tuple[int, ...] | None = None  # classes present in the device's data (HeteroFL masking)
    board: BoardProfile | None = None  # what the board measured (its hello's board_profile, validated)
    tier: int | None = None  # pinned by the server's enrolment (server/enrolment.py), never by the board


@dataclass
class StrategyContext:
    """What every strategy is constructed from (the run's config, resolved)."""

    arch: str
    num_classes: int
    in_channels: int
    image_size: int
    num_clients: int
    total_rounds: int
    seed: int = 0
    schedule: LrSchedule = field(default_factory=LrSchedule)
    local: dict[str, Any] = field(
        default_factory=dict
    )  # local_epochs, batch_size, momentum, weight_decay, ...
    options: dict[str, Any] = field(default_factory=dict)  # method-specific ([method] table)
    model_extra: dict[str, Any] = field(default_factory=dict)
    dataset: str | None = None  # the run's dataset, recorded so exports know normalisation and class names
    # The round deadline and the share of it local training may take (the rest: transfers, the server's work):
    # boards with a measured profile get the largest submodel predicted to train within it (profiler/fit.py).
    deadline_s: float | None = None
    train_share: float = 0.7

    @property
    def batch_size(self) -> int:
        """The run's local batch; a context without one trains at the task records' default."""
        return int(self.local.get("batch_size", TrainParams.batch_size))

    @property
    def momentum(self) -> bool:
        """Whether local SGD keeps a momentum buffer (it costs training memory the planner counts)."""
        return float(self.local.get("momentum", TrainParams.momentum)) > 0.0

    def model_config(self, **overrides: Any) -> ModelConfig:
        """The run's model for a method. The trainable per-block step size is NeFL's own (METHODS §2.a): NeFL
        asks for it; every other method's blocks keep a fixed step of 1 (HeteroFL, FjORD, DepthFL, ScaleFL,
        FeDepth and FedAvg have none)."""
        overrides.setdefault("learnable_step", False)
        return ModelConfig(
            arch=self.arch,
            num_classes=self.num_classes,
            in_channels=self.in_channels,
            image_size=self.image_size,
            extra=dict(self.model_extra),
            **overrides,
        )

    def to_record(self) -> dict[str, Any]:
        """JSON form stored in checkpoint manifests, enough to re-create the strategy (export, inspection)."""
        return {
            "arch": self.arch,
            "num_classes": self.num_classes,
            "in_channels": self.in_channels,
            "image_size": self.image_size,
            "num_clients": self.num_clients,
            "total_rounds": self.total_rounds,
            "seed": self.seed,
            "local": dict(self.local),
            "options": dict(self.options),
            "model_extra": dict(self.model_extra),
            "dataset": self.dataset,
            "deadline_s": self.deadline_s,
            "train_share": self.train_share,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> StrategyContext:
        known = {
            "arch",
            "num_classes",
            "in_channels",
            "image_size",
            "num_clients",
            "total_rounds",
            "seed",
            "local",
            "options",
            "model_extra",
            "dataset",
            "deadline_s",
            "train_share",
        }
        return cls(**{k: v for k, v in record.items() if k in known})
