"""The Strategy interface (assignment + aggregation + named local procedure) and its shared machinery."""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
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
from nestling.profiler.board_profile import BoardProfile
from nestling.profiler.fit import PINNED, Fit, SpeedFeedback, fit_member
from nestling.profiler.planner import device_memory_budget, member_for_budget
from nestling.profiler.speed import samples_trained, steps_trained
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


def option_kind(default: Any) -> tuple[type, ...] | None:
    """The JSON kinds an option with this default accepts (None: any)."""
    if default is None:
        return None
    if isinstance(default, bool):
        return (bool,)
    if isinstance(default, int):
        return (int,)
    if isinstance(default, float):
        return (int, float)
    if isinstance(default, (list, tuple)):
        return (list, tuple)
    return (type(default),)


def check_option(method: str, key: str, value: Any, kinds: tuple[type, ...] | None) -> None:
    """Refuse an option value of the wrong kind, naming the option (bool is not a number here)."""
    if kinds is None:
        return
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    fits = any(
        isinstance(value, bool)
        if kind is bool
        else (is_number and isinstance(value, kind))
        if kind in (int, float)
        else isinstance(value, kind)
        for kind in kinds
    )
    if isinstance(value, float) and is_number and not math.isfinite(value):
        fits = False
    if not fits:
        names = " or ".join(kind.__name__ for kind in kinds)
        raise ConfigError(f"[method] {method} option {key} must be {names}, got {value!r}")


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
    # Each option's type is its default's (an int default takes ints, a float default ints or floats, a list or
    # tuple default a list); options that take several kinds, or whose default is None, declare them here.
    option_types: ClassVar[dict[str, tuple[type, ...] | None]] = {}
    # What a profiled board's plan says when the method does not size it with `fit_by_budget`.
    sizing_reason: ClassVar[str] = "not sized"
    # How `nestling plan` sizes this method's boards from budgets (server/plan_methods.py): "family" (the
    # largest member of `self.specs` that fits), "levels" (ScaleFL's budget clustering), "depthwise" (FeDepth's
    # decompositions), or None when the method has nothing to plan.
    planning: ClassVar[str | None] = None

    def __init__(self, ctx: StrategyContext) -> None:
        unknown = set(ctx.options) - set(self.option_defaults)
        if unknown:
            raise ConfigError(
                f"[method] {self.name} has no options {sorted(unknown)} "
                f"(known: {', '.join(sorted(self.option_defaults)) or 'none'})"
            )
        for key, value in ctx.options.items():
            check_option(
                self.name, key, value, self.option_types.get(key, option_kind(self.option_defaults[key]))
            )
        self.ctx = ctx
        self.options = {**self.option_defaults, **ctx.options}
        self.model = self.make_model_config()
        self.full_spec = SubmodelSpec.full(self.model)
        with torch.random.fork_rng():  # seeded init without disturbing the caller's RNG stream
            torch.manual_seed(ctx.seed)
            self.global_state: dict[str, torch.Tensor] = build(self.full_spec).state_dict()
        self.feedback = SpeedFeedback()  # observed / predicted training time per board (coordinator feeds it)
        self._sizing: dict[
            str, tuple[Fit, str]
        ] = {}  # this round's sizing per board, and the spec id it chose
        self._chosen: dict[str, str] = {}  # the spec id each board's sizing chose last round (re-plans)
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
        """Index of the largest spec that fits the device (profiler.fit.fit_member): its estimated training
        memory within the registered budget (or what the board measured), and, when the board sent a profile
        and the run has a deadline, its predicted local training time within the deadline's training share.
        The cheapest when none fits; None when the device registered neither a budget nor a profile, or the
        enrolment pinned its tier (the operator's word wins over what a board says of itself). The choice and
        its reason are kept for the round's record (`plan_report`)."""
        budget = device_memory_budget(device.memory_budget_bytes, device.profile)
        board = self.board_of(device)
        if device.tier is not None:
            if board is not None:
                self._sizing[device.device_id] = (Fit(-1, PINNED, 0, None), "")
            return None
        if board is None:  # a hand-set budget only: the planner's rule as it always was (nothing: no sizing)
            return None if budget is None else member_for_budget(specs, budget, self.batch_size)
        previous = self._chosen.get(device.device_id)
        current = next((k for k, s in enumerate(specs) if s.id == previous), None)
        fit = fit_member(
            specs,
            self.batch_size,
            memory_budget=budget,
            board=board,
            samples=samples_trained(self.ctx.local, device.num_samples),
            steps=steps_trained(self.ctx.local, device.num_samples),
            time_budget_s=self.time_budget_s,
            speed=self.feedback.factor(device.device_id),
            current=current,
        )
        self._sizing[device.device_id] = (fit, specs[fit.index].id)
        return fit.index

    @property
    def batch_size(self) -> int:
        return int(self.ctx.local.get("batch_size", 32))

    @property
    def time_budget_s(self) -> float | None:
        """Seconds of local training a board may plan for: the deadline's training share."""
        if self.ctx.deadline_s is None:
            return None
        return float(self.ctx.deadline_s) * float(self.ctx.train_share)

    def board_of(self, device: DeviceInfo) -> BoardProfile | None:
        """The device's profile when it measured this run's full model at this run's batch size."""
        board = device.board
        if board is None or board.spec_id != self.full_spec.id or board.batch != self.batch_size:
            return None
        return board

    def memory_budget_of(self, device: DeviceInfo) -> int | None:
        """Hand-set budget (it wins), else the profile's recorded budget, else what the board measured."""
        budget = device_memory_budget(device.memory_budget_bytes, device.profile)
        if budget is not None:
            return budget
        board = self.board_of(device)
        return None if board is None else board.memory_bytes

    def sized_by_fit(self, device: DeviceInfo) -> bool:
        """Whether `fit_by_budget` sizes this device (a budget, or a profile without a pinned tier)."""
        if device_memory_budget(device.memory_budget_bytes, device.profile) is not None:
            return True
        return self.board_of(device) is not None and device.tier is None

    # -- the closed loop: plans, predictions, feedback ----------------------------------------------
    def plan_report(
        self, round_index: int, devices: list[DeviceInfo], tasks: dict[str, Task]
    ) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
        """Per profiled board: the task's spec, why it was chosen, the predicted training time (raw and
        corrected); and the re-plans (a board whose sizing chose another spec than last round)."""
        plans: dict[str, dict[str, Any]] = {}
        replans: list[dict[str, Any]] = []
        for device in devices:
            task, board = tasks.get(device.device_id), self.board_of(device)
            if task is None or board is None:
                continue
            fit, chosen = self._sizing.get(device.device_id, (None, ""))
            raw = board.train_seconds(
                SubmodelSpec.from_dict(task.spec),
                samples_trained(task.hparams, device.num_samples),
                steps_trained(task.hparams, device.num_samples),
            )
            speed = self.feedback.factor(device.device_id)
            plans[device.device_id] = {
                "spec": task.spec_id,
                "reason": fit.reason if fit is not None else self.sizing_reason,
                "predicted_s": raw * speed,
                "raw_predicted_s": raw,
                "speed": speed,
                "memory_bytes": fit.memory_bytes if fit is not None else None,
                "budget_bytes": self.memory_budget_of(device),
                "time_budget_s": self.time_budget_s,
                "source": board.source,
            }
            if fit is not None and chosen:
                before = self._chosen.get(device.device_id)
                if before is not None and before != chosen:
                    replans.append(
                        {
                            "device": device.device_id,
                            "from": before,
                            "to": chosen,
                            "reason": fit.reason,
                            "speed": speed,
                        }
                    )
                self._chosen[device.device_id] = chosen
        self._sizing = {}
        return plans, replans

    def observe_training(
        self, plans: dict[str, dict[str, Any]], observed: dict[str, tuple[float, bool]]
    ) -> None:
        """Fold each planned board's observed training time (seconds, censored by the deadline) into its
        speed factor; the plan entries gain `observed_s`, `censored` and the new `speed_after`."""
        for device_id, (seconds, censored) in observed.items():
            plan = plans.get(device_id)
            if plan is None:
                continue
            plan["observed_s"], plan["censored"] = seconds, censored
            plan["speed_after"] = self.feedback.observe(device_id, plan["raw_predicted_s"], seconds, censored)

    def planning_state(self) -> dict[str, Any]:
        """What the closed loop learned, for checkpoints: each board's speed factor and the spec its sizing
        chose last (a resumed run plans, corrects and reports re-plans exactly as an uninterrupted one)."""
        return {"speed": dict(self.feedback.factors), "chosen": dict(self._chosen)}

    def load_planning_state(self, state: dict[str, Any]) -> None:
        """Restore `planning_state`; a checkpoint from before the closed loop restores nothing."""
        speed, chosen = state.get("speed", {}), state.get("chosen", {})
        if not isinstance(speed, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
            for v in speed.values()
        ):
            raise ConfigError("checkpoint planning.speed must map boards to positive speed factors")
        if not isinstance(chosen, dict) or not all(isinstance(v, str) for v in chosen.values()):
            raise ConfigError("checkpoint planning.chosen must map boards to spec ids")
        self.feedback.factors = {str(k): float(v) for k, v in speed.items()}
        self._chosen = {str(k): v for k, v in chosen.items()}

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

    def write_plots(self, out_dir: Path, summary: dict[str, Any]) -> list[Path]:
        """Plots of this method's own beside accuracy.png (FedTrans: the family's growth); the files written."""
        return []

    def run_summary(self) -> dict[str, Any]:
        """What this method adds to summary.json under `method_report` at the end of a run."""
        return {}

    def deployables(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Every submodel this method deploys, self-described in each checkpoint so that export and boards
        read it without re-creating the strategy (nestling.checkpoint_io)."""
        return pack_deployables(self.model, self.global_export_state(), self.eval_targets())
