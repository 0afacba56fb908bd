"""`run_task`: build exactly the assigned slice, train it with the named procedure, send back the slice."""

from __future__ import annotations

import pytest
import torch

from nestling.edge.procedures import ClientData
from nestling.edge.trainer import run_task
from nestling.errors import ConfigError
from nestling.messages import Task
from nestling.models import ModelConfig, build
from nestling.slicing import extract, shapes_for
from nestling.spec import SubmodelSpec

MODEL = ModelConfig("resnet20", num_classes=4, image_size=8)


@pytest.fixture(scope="module")
def global_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return build(SubmodelSpec.full(MODEL)).state_dict()


def data() -> ClientData:
    return ClientData(
        torch.randn(12, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(12) % 4
    )


def task_for(spec: SubmodelSpec, global_state: dict, *, seed: int = 1, procedure: str = "sgd", **hp) -> Task:
    return Task(
        round=2,
        device_id="dev-00001",
        spec=spec.to_dict(),
        weights=extract(global_state, spec),
        procedure=procedure,
        hparams={"lr": 0.05, "batch_size": 4, "local_steps": 3, "seed": seed, **hp},
        task_id="r2-dev-00001",
    )


def test_result_carries_exactly_the_slice_of_the_task(global_state: dict) -> None:
    spec = SubmodelSpec(MODEL, width=0.5, blocks=(0, 2, 3, 6))
    task = task_for(spec, global_state)
    result = run_task(task, data())
    assert (result.round, result.device_id, result.task_id, result.spec_id) == (
        2,
        "dev-00001",
        task.task_id,
        spec.id,
    )
    assert {k: tuple(v.shape) for k, v in result.weights.items()} == shapes_for(spec)
    assert result.num_samples == 12 and result.metrics["steps"] == 3
    assert result.metrics["train_seconds"] > 0 and result.metrics["loss_first"] is not None
    changed = [
        k for k, v in result.weights.items() if v.is_floating_point() and not torch.equal(v, task.weights[k])
    ]
    assert "blocks.0.conv1.weight" in changed and "head.fc.bias" in changed


def test_the_task_seed_makes_training_reproducible(global_state: dict) -> None:
    spec = SubmodelSpec(MODEL, width=0.5)
    a, b = run_task(task_for(spec, global_state), data()), run_task(task_for(spec, global_state), data())
    c = run_task(task_for(spec, global_state, seed=2), data())
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert not all(torch.equal(a.weights[k], c.weights[k]) for k in a.weights)


def test_parameters_without_gradient_are_not_uploaded() -> None:
    model = ModelConfig(
        "resnet20",
        num_classes=4,
        image_size=8,
        exit_points=(2,),
        exit_kind="scalefl",
        scaler="always",
        norm_stats="batch",
        rounding="floor",
        learnable_step=False,
    )
    torch.manual_seed(0)
    spec = SubmodelSpec(model, width=0.5, depth=3, exits=(2,), head=False)
    state = build(SubmodelSpec.full(model)).state_dict()
    result = run_task(task_for(spec, state, procedure="scalefl-sd", total_rounds=4), data())
    assert not any(k.endswith(".step") for k in result.weights)
    assert set(result.metrics["untouched"]) == {"blocks.0.step", "blocks.1.step", "blocks.2.step"}


def test_weights_that_do_not_match_the_spec_are_refused(global_state: dict) -> None:
    spec = SubmodelSpec(MODEL, width=0.5)
    task = task_for(SubmodelSpec(MODEL, width=0.5), global_state)
    task.weights = extract(global_state, SubmodelSpec(MODEL, width=0.75))
    with pytest.raises(RuntimeError, match="size mismatch"):
        run_task(task, data())
    task = task_for(spec, global_state, procedure="no-such-procedure")
    with pytest.raises(ConfigError, match="unknown local procedure 'no-such-procedure'"):
        run_task(task, data())


def test_the_procedure_receives_its_typed_record_built_once_from_the_task(global_state: dict) -> None:
    """The JSON hyper-parameters become the procedure's record where the task arrives, at the task's round; a
    JSON integer in a float field arrives as that float."""
    from nestling.edge.procedures import (
        LocalOutcome,
        register_procedure,
        restore_procedures,
        snapshot_procedures,
    )
    from nestling.task_params import FjordParams

    seen: list[object] = []
    saved = snapshot_procedures()
    try:

        @register_procedure("test-trainer-record", params=FjordParams)
        def record(model, data, hp, store, generator):  # type: ignore[no-untyped-def]
            seen.append(hp)
            return LocalOutcome(model, len(data), [], 0)

        spec = SubmodelSpec(MODEL, width=0.5)
        run_task(task_for(spec, global_state, procedure="test-trainer-record", lr=1, p_max=0.5), data())
        with pytest.raises(ConfigError, match="'p_max' for procedure 'test-trainer-record'"):
            run_task(task_for(spec, global_state, procedure="test-trainer-record", p_max="wide"), data())
    finally:
        restore_procedures(saved)
    (hp,) = seen
    assert isinstance(hp, FjordParams) and hp.round == 2 and hp.seed == 1 and hp.batch_size == 4
    assert isinstance(hp.lr, float) and hp.lr == 1.0 and hp.p_max == 0.5 and hp.fjord_kd is False


def test_a_task_with_a_key_its_procedure_does_not_know_is_refused_before_training(global_state: dict) -> None:
    spec = SubmodelSpec(MODEL, width=0.5)
    with pytest.raises(ConfigError, match=r"procedure 'sgd': unknown \['learning_rate'\]"):
        run_task(task_for(spec, global_state, learning_rate=0.1), data())
