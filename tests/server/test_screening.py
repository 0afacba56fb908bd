"""Update screening and clipping on their own: sizes, the round-relative outlier rule, the absolute bound."""

from __future__ import annotations

import math

import pytest
import torch

from nestling.errors import ConfigError
from nestling.messages import Result, Task
from nestling.server.screening import (
    RobustPolicy,
    UpdateSize,
    absolute_reason,
    clip_update,
    outliers,
    update_size,
)


def pair(update: float, n: int = 4) -> tuple[Task, Result]:
    task = Task(
        round=0,
        device_id="d",
        spec={},
        weights={"w": torch.ones(n), "steps": torch.tensor(3)},
        procedure="sgd",
        task_id="t",
    )
    result = Result(
        round=0,
        device_id="d",
        task_id="t",
        spec_id="s",
        num_samples=1,
        weights={"w": torch.ones(n) + update, "steps": torch.tensor(9)},
    )
    return task, result


def test_update_size_skips_integer_buffers_and_overflow_is_non_finite() -> None:
    assert update_size(*pair(0.5)) == UpdateSize(1.0, 4)  # sqrt(4 * 0.25)
    huge = update_size(*pair(3.0e38))
    assert huge.norm == math.inf and absolute_reason(huge, RobustPolicy()) == "non-finite update"


def test_outliers_are_judged_against_the_others_median_rms() -> None:
    sizes = [UpdateSize(1.0, 100), UpdateSize(1.2, 100), UpdateSize(0.1, 1), UpdateSize(100.0, 100)]
    refused = outliers(sizes, RobustPolicy())
    assert list(refused) == [3]  # the small submodel's update (rms 0.1) is not an outlier
    assert "median" in refused[3]
    assert list(outliers([UpdateSize(1.0, 10), UpdateSize(50.0, 10)], RobustPolicy())) == [
        1
    ]  # two boards suffice


def test_absolute_bound_and_clipping() -> None:
    policy = RobustPolicy(max_update_norm=0.5)
    task, result = pair(0.5)
    assert "above the bound" in absolute_reason(update_size(task, result), policy)
    clipped = clip_update(task, result, update_size(task, result).norm, 0.5)
    assert update_size(task, clipped).norm == pytest.approx(0.5)
    assert torch.equal(clipped.weights["steps"], result.weights["steps"])
    assert clip_update(task, result, 1.0, 2.0) is result


def test_bad_settings_are_named() -> None:
    with pytest.raises(ConfigError, match="aggregation"):
        RobustPolicy(aggregation="mode")
    with pytest.raises(ConfigError, match="update_norm_factor"):
        RobustPolicy(update_norm_factor=1.0)
