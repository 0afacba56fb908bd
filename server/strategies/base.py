"""The Strategy interface: what the coordinator drives round by round, and nothing a method need not say.

A method is built from the run's context and implements seven methods: assignment (`assign`), the check of an upload against its task (`validate`),
aggregation (`aggregate`), what is evaluated (`eval_targets`) and its checkpoint state (`state_tensors`,
`state_meta`, `load_state`). What else the coordinator, checkpoints and reports ask of a strategy comes from
mix-ins with working defaults, each with one job: board sizing and its closed loop (`sizing.BoardSizing`), the
method's own reports and plots (`reports.MethodReports`) and what it deploys (`deployment.Deployment`). The
built-in methods subclass `SubmodelStrategy` (server/strategies/submodel.py), which adds one global model
sliced into submodels, the masked-mean aggregation and the per-round randomness they share.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from nestling.eval_target import EvalTarget
from nestling.messages import Result, Task
from nestling.models.config import ModelConfig
from nestling.server.strategies.context import DeviceInfo, StrategyContext
from nestling.server.strategies.deployment import Deployment
from nestling.server.strategies.options import MethodOptions
from nestling.server.strategies.reports import MethodReports
from nestling.server.strategies.sizing import BoardSizing
from nestling.spec import SubmodelSpec


class Strategy(BoardSizing, MethodReports, Deployment, ABC):
    """Owns the server-side model state of one method; the coordinator drives it round by round.

    State is a set of named tensors (one global model for most methods; several, or per-submodel
    stores, for others) plus JSON metadata, so checkpoints need no method-specific code.
    """

    name: ClassVar[str]
    procedure: ClassVar[str] = "sgd"
    # ScaleFL uploads only tensors that received a gradient; every other method must upload its whole slice.
    partial_uploads: ClassVar[bool] = False
    # The method's `[method]` options as one typed record (server/strategies/options.py) and its defaults by
    # name (what the CLI lists; derived from the record by `SubmodelStrategy`).
    options_type: ClassVar[type[MethodOptions]] = MethodOptions
    option_defaults: ClassVar[dict[str, Any]] = {}

    ctx: StrategyContext
    options: MethodOptions
    model: ModelConfig
    full_spec: SubmodelSpec
    global_state: dict[str, torch.Tensor]

    def __init__(self, ctx: StrategyContext) -> None:
        """Every strategy is built from the run's resolved context (`create_strategy(name, ctx)`)."""
        self.ctx = ctx

    @abstractmethod
    def assign(self, round_index: int, devices: list[DeviceInfo]) -> dict[str, Task]:
        """One task per selected device: its submodel, the weights it trains, its procedure and hyper-parameters."""

    @abstractmethod
    def validate(self, task: Task, result: Result) -> None:
        """Refuse (SpecError) a result that does not match its task: names, shapes, dtypes, NaN/Inf, samples."""

    @abstractmethod
    def aggregate(self, round_index: int, accepted: list[tuple[Task, Result]]) -> None:
        """Fold the round's accepted results into the state, replacing tensors (never writing in place: the
        divergence guard keeps the previous state by reference)."""

    @abstractmethod
    def eval_targets(self) -> list[EvalTarget]:
        """Every submodel the method reports accuracy for, smallest first."""

    @abstractmethod
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state, by checkpoint name."""

    @abstractmethod
    def state_meta(self) -> dict[str, Any]:
        """The state's JSON part (checkpoint manifest's `strategy`)."""

    @abstractmethod
    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore what `state_tensors` and `state_meta` saved, refusing a checkpoint of another model."""


__all__ = ["DeviceInfo", "EvalTarget", "Strategy", "StrategyContext"]
