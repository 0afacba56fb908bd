"""One board's figures that make a strategy raise leave that board out of the round, never the server."""

from __future__ import annotations

import math

import pytest

from nestling.messages import Result, Task
from nestling.server.board_guard import (
    assign_guarded,
    finite_metric,
    local_train_seconds,
    mean_train_loss,
    observed_seconds,
)
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.server.strategies.base import DeviceInfo

CTX = StrategyContext(
    arch="tinycnn", num_classes=10, in_channels=1, image_size=16, num_clients=3, total_rounds=4, seed=0
)


@pytest.mark.parametrize(
    "method", ["nefl-wd", "nefl-w", "dynamicfl", "fedtrans"]
)  # the ones that read a tier
def test_a_board_whose_assignment_raises_is_refused_and_the_others_are_assigned(method: str) -> None:
    """A DeviceInfo built past the enrolment's checks (as a plugin transport might): its tier is not a number."""
    strategy = create_strategy(method, CTX)
    boards = [DeviceInfo(f"b{i}", i, 20) for i in range(2)]
    bad = DeviceInfo("bad", 2, 20, tier="abc")  # type: ignore[arg-type]
    refused: list[tuple[str, str]] = []
    tasks = assign_guarded(strategy, 0, [*boards, bad], lambda d, why: refused.append((d, why)))
    assert sorted(tasks) == ["b0", "b1"]
    assert [d for d, _ in refused] == ["bad"] and "Error" in refused[0][1]  # the exception, named


def test_an_error_no_single_board_causes_is_the_servers_and_raised() -> None:
    strategy = create_strategy("fedavg", CTX)

    def broken(round_index: int, devices: list[DeviceInfo]) -> dict[str, Task]:
        if len(devices) > 1:
            raise RuntimeError("a bug of the strategy itself")
        return {}

    strategy.assign = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="bug of the strategy"):
        assign_guarded(strategy, 0, [DeviceInfo("a", 0, 1), DeviceInfo("b", 1, 1)], lambda d, w: None)


def _result(metrics: dict) -> tuple[Task, Result]:
    task = Task(0, "b", {}, {}, "plain", task_id="t")
    return task, Result(0, "b", "t", "s", {}, 1, metrics)


@pytest.mark.parametrize("value", ["fast", None, True, [1.0], math.inf, math.nan, 10**400, {"s": 1}])
def test_a_metric_that_is_not_a_finite_number_reads_as_nothing(value: object) -> None:
    pair = _result({"train_seconds": value, "loss_mean": value, "train_wall_s": value})
    assert finite_metric(pair[1].metrics, "train_seconds") is None
    assert local_train_seconds([pair]) == 0.0 and mean_train_loss([pair]) is None
    assert observed_seconds({"b": {}}, [pair], 2.0) == {"b": (2.0, True)}


def test_finite_metrics_are_summed_and_averaged() -> None:
    pairs = [
        _result({"train_seconds": 2, "loss_mean": 1.0}),
        _result({"train_seconds": 0.5, "loss_mean": 3.0}),
    ]
    assert local_train_seconds(pairs) == 2.5 and mean_train_loss(pairs) == 2.0
    assert observed_seconds({}, [_result({"train_wall_s": 4.0, "train_seconds": 1.0})], 9.0) == {
        "b": (4.0, False)
    }
