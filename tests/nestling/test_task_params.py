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
