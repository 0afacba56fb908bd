"""The Strategy interface (assignment + aggregation + named local procedure) and its shared machinery."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from nestling.aggregation import Contribution, masked_mean
from nestling.checkpoint_io import pack_deployables
from nestling.errors import ConfigError, SpecError
from nestling.eval_target import EvalTarget
from nestling.messages import Result, Task
from nestling.models.config import ModelConfig
from nestling.models.zoo import build
from nestling.profiler.planner import device_memory_budget, member_for_budget
from nestling.schedule import LrSchedule
from nestling.slicing import check_result_tensors, extract, slices_for
from nestling.spec import SubmodelSpec


@dataclass
class DeviceInfo:
    """A registered device as strategies see it: a stable index (tiers), data size, optional profile."""

    device_id: str
    index: int
    num_samples: int
    profile: dict[str, Any] | None = None
    memory_budget_bytes: int | None = None
    labels: tuple[int, ...] | None = None  # classes present in the device's data (HeteroFL masking)


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
        }
        return cls(**{k: v for k, v in record.items() if k in known})


class Strategy(ABC):
    """Owns the server-side model state of one method; the coordinator drives it round by round.

    State is a set of named tensors (one global model for most methods; several, or per-submodel
    stores, for others) plus JSON metadata, so checkpoints need no method-specific code.
    """

    name: ClassVar[str]
    procedure: ClassVar[str] = "sgd"
    # ScaleFL uploads only tensors that received a gradient; every other method must upload its whole slice.
    partial_uploads: ClassVar[bool] = False
    option_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, ctx: StrategyContext) -> None:
        unknown = set(ctx.options) - set(self.option_defaults)
        if unknown:
            raise ConfigError(
                f"[method] {self.name} has no options {sorted(unknown)} "
                f"(known: {', '.join(sorted(self.option_defaults)) or 'none'})"
            )
        self.ctx = ctx
        self.options = {**self.option_defaults, **ctx.options}
        self.model = self.make_model_config()
        self.full_spec = SubmodelSpec.full(self.model)
        with torch.random.fork_rng():  # seeded init without disturbing the caller's RNG stream
            torch.manual_seed(ctx.seed)
            self.global_state: dict[str, torch.Tensor] = build(self.full_spec).state_dict()
        self.setup()

    # -- what each method defines -------------------------------------------------------------
    def make_model_config(self) -> ModelConfig:
        return self.ctx.model_config()

    def setup(self) -> None:  # noqa: B027 - an optional hook: most strategies need no extra state
        """Method-specific state built after the global model exists."""

    @abstractmethod
    def spec_for(self, round_index: int, device: DeviceInfo) -> SubmodelSpec:
        """The submodel this device trains this round."""

    @abstractmethod
    def eval_targets(self) -> list[EvalTarget]:
        """Every submodel the method reports accuracy for, smallest first."""

    def deploy_spec(self, device: DeviceInfo, last_round: int) -> SubmodelSpec:
        """The submodel a device deploys when the run ends (server/deployables.py): by default the one it
        would train in the last round."""
        return self.spec_for(last_round, device)

    def aggregation_weight(self, result: Result) -> float:
        return 1.0

    def fit_by_budget(self, device: DeviceInfo, specs: list[SubmodelSpec]) -> int | None:
        """Index of the largest spec whose estimated training memory fits the device's registered budget
        (the cheapest when none fits); None when the device registered no budget."""
        budget = device_memory_budget(device.memory_budget_bytes, device.profile)
        if budget is None:
            return None
        return member_for_budget(specs, budget, int(self.ctx.local.get("batch_size", 32)))

    # -- shared machinery ---------------------------------------------------------------------
    def round_rng(self, round_index: int, salt: int = 0) -> np.random.Generator:
        """Per-round randomness derived from the seed only: a resumed run draws exactly the same."""
        return np.random.default_rng([self.ctx.seed, round_index, salt])

    def task_seed(self, round_index: int, device_id: str) -> int:
        digest = hashlib.sha256(f"{self.ctx.seed}/{round_index}/{device_id}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    def local_hparams(self, round_index: int, device: DeviceInfo, spec: SubmodelSpec) -> dict[str, Any]:
        hp = dict(self.ctx.local)
        hp["lr"] = self.ctx.schedule.at(round_index, self.ctx.total_rounds)
        hp["seed"] = self.task_seed(round_index, device.device_id)
        hp["total_rounds"] = self.ctx.total_rounds
        return hp

    def task_weights(self, spec: SubmodelSpec) -> dict[str, torch.Tensor]:
        return extract(self.global_state, spec)

    def assign(self, round_index: int, devices: list[DeviceInfo]) -> dict[str, Task]:
        tasks: dict[str, Task] = {}
        for device in devices:
            spec = self.spec_for(round_index, device)
            tasks[device.device_id] = Task(
                round=round_index,
                device_id=device.device_id,
                spec=spec.to_dict(),
                weights=self.task_weights(spec),
                procedure=self.procedure,
                hparams=self.local_hparams(round_index, device, spec),
                task_id=f"r{round_index}-{device.device_id}",
            )
        return tasks

    def validate(self, task: Task, result: Result) -> None:
        """Reject a result that does not match its task (names, shapes, dtypes, NaN/Inf)."""
        spec = SubmodelSpec.from_dict(task.spec)
        check_result_tensors(result.weights, spec, self.global_state)
        if not self.partial_uploads:
            missing = sorted(set(task.weights) - set(result.weights))
            if missing:
                raise SpecError(
                    f"result of {result.device_id} lacks {len(missing)} tensors of its slice, e.g. {missing[:3]}"
                )
        if result.num_samples < 1:
            raise SpecError(f"result of {result.device_id} reports {result.num_samples} training samples")

    def contributions(
        self, accepted: list[tuple[Task, Result]], keys: set[str] | None = None
    ) -> list[Contribution]:
        out = []
        for task, result in accepted:
            spec = SubmodelSpec.from_dict(task.spec)
            tensors = (
                result.weights if keys is None else {k: v for k, v in result.weights.items() if k in keys}
            )
            out.append(Contribution(tensors, slices_for(spec), self.aggregation_weight(result)))
        return out

    def aggregate(self, round_index: int, accepted: list[tuple[Task, Result]]) -> None:
        """Masked mean of all uploaded tensors (METHODS §1.2); untouched elements keep their values."""
        self.global_state.update(masked_mean(self.global_state, self.contributions(accepted)))

    # -- checkpoints --------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"global/{k}": v for k, v in self.global_state.items()}

    def state_meta(self) -> dict[str, Any]:
        return {}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        for key in self.global_state:
            stored = tensors.get(f"global/{key}")
            if stored is None or stored.shape != self.global_state[key].shape:
                raise ConfigError(f"checkpoint does not match the {self.name} model at tensor '{key}'")
            self.global_state[key] = stored.clone()

    def global_export_state(self) -> dict[str, torch.Tensor]:
        """The full model's weights as deployed (NeFL: consistent weights + the largest submodel's BN)."""
        return self.global_state

    def round_report(self, round_index: int, accepted: list[tuple[Task, Result]]) -> dict[str, Any]:
        """What this method did in a round beyond the common record (metrics.jsonl's `method` field): DynamicFL's
        expanded convs per capacity, FedTrans's model births. `accepted` are the results it aggregated."""
        return {}

    def run_summary(self) -> dict[str, Any]:
        """What this method adds to summary.json under `method_report` at the end of a run."""
        return {}

    def deployables(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Every submodel this method deploys, self-described in each checkpoint so that export and boards
        read it without re-creating the strategy (nestling.checkpoint_io)."""
        return pack_deployables(self.model, self.global_export_state(), self.eval_targets())
