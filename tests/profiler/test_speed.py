"""The cost model's counts of one task: the steps it takes and the samples it draws, as the local procedures do."""

from __future__ import annotations

import pytest
import torch

from nestling.edge.procedures import ClientData
from nestling.edge.procedures.common import batches
from nestling.profiler.speed import samples_trained, steps_trained
from nestling.task_params import TrainParams


def test_steps_are_whole_batches_a_partial_one_included() -> None:
    assert steps_trained({"local_epochs": 1, "batch_size": 32}, 100) == 4  # 32+32+32+4
    assert steps_trained({"local_epochs": 3, "batch_size": 32}, 180) == 18  # 3 x (5 of 32 + one of 20)
    assert steps_trained({"local_steps": 5, "batch_size": 8}, 30) == 5
    assert (
        steps_trained({"local_epochs": 2, "batch_size": 4}, 9) == 6
    )  # single leftovers skipped, not counted
    assert steps_trained({"local_epochs": 2}, 0) == 0


@pytest.mark.parametrize("n", [1, 2, 7, 9, 16, 17, 30])
@pytest.mark.parametrize(
    "hp",
    [
        {"local_epochs": 1, "batch_size": 8},
        {"local_epochs": 3, "batch_size": 4},
        {"local_steps": 7, "batch_size": 8},
        {"local_steps": 3, "batch_size": 64},
        {"local_epochs": 2, "batch_size": 2},
    ],
)
def test_steps_and_samples_are_what_the_local_procedures_really_take(n: int, hp: dict) -> None:
    data = ClientData(torch.zeros(n, 1, 2, 2), torch.zeros(n, dtype=torch.long))
    drawn = [len(y) for _, y in batches(data, TrainParams.from_hparams(hp), torch.Generator().manual_seed(0))]
    assert steps_trained(hp, n) == len(drawn) and samples_trained(hp, n) == sum(drawn)
