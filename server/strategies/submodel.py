"""The concrete base of the built-in methods: one global model, sliced into the submodel each board trains,
aggregated by the masked mean of METHODS §1.2. A method on it says which submodel a board trains (`spec_for`)
and what is evaluated (`eval_targets`); everything else has a default it may override."""

from __future__ import annotations

import hashlib
from abc import abstractmethod
from typing import Any

import numpy as np
import torch

from nestling.aggregation import Contribution, masked_mean
from nestling.errors import SpecError
from nestling.messages import Result, Task
from nestling.models.config import ModelConfig
from nestling.models.zoo import build
from nestling.server.strategies.base import Strategy
from nestling.server.strategies.checkpoint_state import GlobalModelState
from nestling.server.strategies.context import DeviceInfo, StrategyContext
from nestling.slicing import check_result_tensors, extract, slices_for
from nestling.spec import SubmodelSpec


class SubmodelStrategy(GlobalModelState, Strategy):
    """Built from the run's context: its typed options, its model, and the seeded global model's weights."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.option_defaults = cls.options_type.defaults()

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.options = self.options_type.from_table(self.name, ctx.options)
        self.model = self.make_model_config()
        self.full_spec = SubmodelSpec.full(self.model)
        with torch.random.fork_rng():  # seeded init without disturbing the caller's RNG stream
            torch.manual_seed(ctx.seed)
            self.global_state = build(self.full_spec).state_dict()
        self.setup()

    # -- what each method defines -------------------------------------------------------------
    def make_model_config(self) -> ModelConfig:
        return self.ctx.model_config()

    def setup(self) -> None:
        """Method-specific state built after the global model exists."""

    @abstractmethod
    def spec_for(self, round_index: int, device: DeviceInfo) -> SubmodelSpec:
        """The submodel this device trains this round."""

    def deploy_spec(self, device: DeviceInfo, last_round: int) -> SubmodelSpec:
        """The submodel a device deploys when the run ends (server/deployables.py): by default the one it
        would train in the last round."""
        return self.spec_for(last_round, device)

    def aggregation_weight(self, result: Result) -> float:
        return 1.0

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


__all__ = ["SubmodelStrategy"]
