"""Task hyper-parameters are typed records: a board names the unknown key or the mistyped value it refuses."""

from __future__ import annotations

import pytest

from nestling.errors import ConfigError
from nestling.task_params import DynamicflParams, FjordParams, TrainParams


def test_a_record_reads_json_values_and_keeps_defaults() -> None:
    params = DynamicflParams.from_hparams({"lr": 1, "capacity": 2, "inner_width": None, "label_set": [0, 3]})
    assert (
        params.lr == 1 and params.capacity == 2 and params.protocol == "paper" and params.label_set == [0, 3]
    )
    assert DynamicflParams.from_hparams(params.to_hparams()) == params


@pytest.mark.parametrize(
    "hp, named",
    [
        ({"learning_rate": 0.1}, "learning_rate"),  # a typo is not silently ignored
        ({"lr": "0.1"}, "'lr'"),
        ({"lr": float("nan")}, "'lr'"),
        ({"batch_size": 32.0}, "'batch_size'"),
        ({"batch_size": True}, "'batch_size'"),
        ({"masked_ce": 1}, "'masked_ce'"),
        ({"label_set": [0, "1"]}, "'label_set'"),
        ({"local_steps": [3]}, "'local_steps'"),
    ],
)
def test_wrong_keys_and_types_are_refused_by_name(hp: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        TrainParams.from_hparams(hp)


def test_each_procedure_knows_only_its_own_keys() -> None:
    FjordParams.from_hparams({"p_max": 0.5, "widths": [0.25, 0.5, 1.0], "fjord_kd": True})
    with pytest.raises(ConfigError, match=r"procedure 'sgd': unknown \['p_max'\]"):
        TrainParams.from_hparams({"p_max": 0.5})


def test_json_integers_in_float_fields_become_floats_and_other_values_stay_as_sent() -> None:
    """A record holds what its annotations say: `lr: 1` arrives as 1.0 (what `float(hp["lr"])` gave the procedures)."""
    params = FjordParams.from_hparams(
        {"lr": 1, "grad_clip": 2, "widths": [1, 0.5], "p_max": 1, "batch_size": 8, "label_set": [1, 2]}
    )
    assert type(params.lr) is float and type(params.grad_clip) is float and type(params.p_max) is float
    assert params.widths == [1.0, 0.5] and all(type(w) is float for w in params.widths)
    assert type(params.batch_size) is int and params.label_set == [1, 2]
    from nestling.task_params import FedepthParams

    assert FedepthParams.from_hparams({"stage_steps": 3}).stage_steps == 3  # str | int keeps the int
    assert FedepthParams.from_hparams({"stage_steps": "split"}).stage_steps == "split"


def test_the_run_config_starts_from_the_records_defaults() -> None:
    """One place for the optimiser's and batching's defaults: the [train] section reads them from TrainParams."""
    from nestling.config import TrainSection
    from nestling.schedule import LrSchedule

    train, record = TrainSection(), TrainParams()
    assert (train.lr, train.batch_size, train.momentum, train.weight_decay) == (
        record.lr,
        record.batch_size,
        record.momentum,
        record.weight_decay,
    )
    assert LrSchedule().lr == record.lr


@pytest.mark.parametrize(
    "hp, named",
    [
        ({"batch_size": 0}, "'batch_size' must be >= 1"),
        ({"lr": -0.1}, "'lr' must be >= 0"),
        ({"local_steps": -1}, "'local_steps' must be >= 0"),
        ({"grad_clip": -1.0}, "'grad_clip' must be >= 0"),
        ({"total_rounds": 0}, "'total_rounds' must be >= 1"),
    ],
)
def test_values_out_of_range_are_refused_by_name_and_procedure(hp: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=f"{named}.*procedure 'fjord'"):
        FjordParams.from_hparams(hp, "fjord")
    with pytest.raises(ConfigError, match=named):
        TrainParams(**hp)  # a record built in code is held to the same bounds
