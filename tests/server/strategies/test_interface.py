"""The Strategy interface is small: a method built on it alone implements seven methods, and the coordinator's
round loop, checkpoints, reports and deployables work with the mix-ins' defaults."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

from nestling.errors import SpecError
from nestling.messages import Result, Task
from nestling.models.zoo import build
from nestling.server.checkpoint import latest_checkpoint, load_checkpoint
from nestling.server.clock import VirtualClock
from nestling.server.coordinator import Coordinator, RoundPolicy
from nestling.server.strategies import DeviceInfo, EvalTarget, Strategy, StrategyContext
from nestling.server.strategies.submodel import SubmodelStrategy
from nestling.spec import SubmodelSpec
from tests.server.test_coordinator import ScriptedTransport, fleet, result_for


class MeanOfAll(Strategy):
    """Every board trains the whole model; the plain mean of the uploads replaces it (written from scratch)."""

    name = "lab-mean-of-all"

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.model = ctx.model_config()
        self.full_spec = SubmodelSpec.full(self.model)
        torch.manual_seed(ctx.seed)
        self.global_state = build(self.full_spec).state_dict()

    def assign(self, round_index: int, devices: list[DeviceInfo]) -> dict[str, Task]:
        return {
            d.device_id: Task(
                round=round_index,
                device_id=d.device_id,
                spec=self.full_spec.to_dict(),
                weights={k: v.clone() for k, v in self.global_state.items()},
                procedure=self.procedure,
                hparams={"lr": 0.1, "seed": round_index},
                task_id=f"r{round_index}-{d.device_id}",
            )
            for d in devices
        }

    def validate(self, task: Task, result: Result) -> None:
        if set(result.weights) != set(task.weights):
            raise SpecError(f"result of {result.device_id} does not carry the model's tensors")

    def aggregate(self, round_index: int, accepted: list[tuple[Task, Result]]) -> None:
        self.global_state = {
            k: torch.stack([r.weights[k].to(v.dtype) for _, r in accepted]).mean(dim=0).to(v.dtype)
            if v.is_floating_point()
            else v
            for k, v in self.global_state.items()
        }

    def eval_targets(self) -> list[EvalTarget]:
        return [EvalTarget("full", self.full_spec, self.global_state)]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.global_state)

    def state_meta(self) -> dict[str, Any]:
        return {"kind": "mean-of-all"}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.global_state = {k: tensors[k].clone() for k in self.global_state}


def _defined(cls: type) -> list[str]:
    return [n for n, v in vars(cls).items() if inspect.isfunction(v) or isinstance(v, property)]


def test_the_abstract_interface_defines_at_most_eight_methods() -> None:
    assert len(_defined(Strategy)) <= 8, _defined(Strategy)
    assert sorted(Strategy.__abstractmethods__) == [
        "aggregate",
        "assign",
        "eval_targets",
        "load_state",
        "state_meta",
        "state_tensors",
        "validate",
    ]
    assert sorted(SubmodelStrategy.__abstractmethods__) == ["eval_targets", "spec_for"]


def test_a_method_missing_part_of_the_interface_is_refused_by_name(make_ctx) -> None:
    class NoAggregate(MeanOfAll):
        aggregate = Strategy.aggregate  # type: ignore[assignment]

    with pytest.raises(TypeError, match="aggregate"):
        NoAggregate(make_ctx())  # type: ignore[abstract]


def test_a_method_on_the_interface_alone_runs_rounds_checkpoints_and_resumes(
    make_ctx, tmp_path: Path
) -> None:
    devices = fleet(4)
    strategy = MeanOfAll(make_ctx(num_clients=4))
    policy = RoundPolicy(rounds=2, fraction=1.0, seed=3)
    transport = ScriptedTransport(devices, lambda tasks: [result_for(t, 0.25) for t in tasks])
    records = Coordinator(strategy, transport, VirtualClock(), None, policy, tmp_path).run()
    assert [r.round for r in records] == [0, 1] and all(r.aggregated for r in records)
    assert all(torch.all(v == 0.25) for v in strategy.global_state.values() if v.is_floating_point())
    # the optional parts' defaults: no method report, no plots, no profiled board to plan, one deployable
    assert strategy.round_report(1, []) == {} and strategy.run_summary() == {}
    assert strategy.write_plots(tmp_path, {}) == []
    assert strategy.plan_report(1, devices, {}) == ({}, [])
    assert strategy.deploy_spec(devices[0], 1) == strategy.full_spec
    path = latest_checkpoint(tmp_path / "checkpoints")
    assert path is not None
    manifest = load_checkpoint(path)[1]
    assert manifest["strategy"] == {"kind": "mean-of-all"}
    assert manifest["planning"] == {"speed": {}, "chosen": {}}
    again = MeanOfAll(make_ctx(num_clients=4))
    resumed = Coordinator(
        again, ScriptedTransport(devices, lambda t: []), VirtualClock(), None, policy, tmp_path
    )
    assert resumed.resume() == 2
    assert all(torch.equal(again.global_state[k], v) for k, v in strategy.global_state.items())
