"""Aggregation with a way back, on a real FedAvg strategy and real tensors: an aggregation that fails, explodes
or (seen a round later) poisoned the model is undone and the boards it applied are quarantined."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from nestling.messages import Result, Task
from nestling.server.divergence_guard import DivergenceGuard
from nestling.server.screening import RobustPolicy
from nestling.server.strategies import Strategy, create_strategy
from tests.server.round_helpers import fleet, result_for

Pairs = list[tuple[Task, Result]]


def answered(strategy: Strategy, round_index: int, *values: float) -> Pairs:
    """Round `round_index`'s tasks for len(values) boards, answered with those values."""
    tasks = list(strategy.assign(round_index, fleet(len(values))).values())
    return [(task, result_for(task, value)) for task, value in zip(tasks, values, strict=True)]


def state_of(strategy: Strategy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in strategy.global_state.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def strategy(make_ctx) -> Strategy:
    return create_strategy("fedavg", make_ctx(num_clients=3))


def test_a_sound_aggregation_is_applied(strategy: Strategy) -> None:
    guard = DivergenceGuard(strategy, RobustPolicy())
    counters: Counter[str] = Counter()
    assert guard.aggregate(0, answered(strategy, 0, 1.0, 2.0, 3.0), counters)
    floats = [v for v in strategy.global_state.values() if v.is_floating_point()]
    assert all(torch.allclose(v, torch.full_like(v, 2.0)) for v in floats) and not counters
    assert guard.seconds > 0.0


def test_an_exploding_aggregation_is_rolled_back(strategy: Strategy) -> None:
    guard = DivergenceGuard(strategy, RobustPolicy(divergence_factor=100.0))
    before, counters = state_of(strategy), Counter[str]()
    assert not guard.aggregate(0, answered(strategy, 0, 1e6, 1e6, 1e6), counters)
    assert same(state_of(strategy), before) and counters == Counter({"rolled_back": 1})
    assert guard.aggregate(
        0, answered(strategy, 0, 50.0, 50.0, 50.0), counters
    )  # x50 of max(|w|, 1): allowed


def test_a_failing_aggregation_is_undone_with_the_guard_and_raised_without(strategy: Strategy) -> None:
    pairs = answered(strategy, 0, 1.0, 2.0, 3.0)
    pairs[1][1].weights["head.fc.bias"] = torch.ones(99)  # slipped past validation: no slice fits it
    before, counters = state_of(strategy), Counter[str]()
    assert not DivergenceGuard(strategy, RobustPolicy()).aggregate(0, pairs, counters)
    assert same(state_of(strategy), before) and counters == Counter({"aggregation_failed": 1})
    with pytest.raises(RuntimeError):  # what the strategy raised, unchanged
        DivergenceGuard(strategy, RobustPolicy(divergence_guard=False)).aggregate(0, pairs, counters)


def test_a_poisoned_previous_round_is_undone_and_its_boards_quarantined(strategy: Strategy) -> None:
    guard = DivergenceGuard(strategy, RobustPolicy(quarantine_rounds=2))
    counters: Counter[str] = Counter()
    before = state_of(strategy)
    pairs = answered(strategy, 0, 1.0, 2.0)
    assert guard.aggregate(0, pairs, counters)
    applied = state_of(strategy)
    everyone = {"dev-00000", "dev-00001", "dev-00002"}
    assert guard.undo_previous(1, {"dev-00000"}, everyone, counters) == (None, [])  # a minority
    assert guard.undo_previous(2, {"dev-00000", "dev-00001"}, everyone, counters) == (
        None,
        [],
    )  # not round 1's
    assert same(state_of(strategy), applied) and not counters
    assert guard.undo_previous(1, {"dev-00001", "dev-00002"}, everyone, counters) == (
        0,
        ["dev-00000", "dev-00001"],
    )
    assert same(state_of(strategy), before) and counters == Counter({"rolled_back": 1})
    assert guard.quarantine == {"dev-00000": 4, "dev-00001": 4}  # skipped in rounds 2 and 3
    assert guard.quarantine_log == [{"round": 1, "devices": ["dev-00000", "dev-00001"], "until_round": 4}]
    assert guard.undo_previous(1, everyone, everyone, counters) == (None, [])  # nothing left to undo


def test_quarantined_devices_are_not_available_until_their_round(strategy: Strategy) -> None:
    guard = DivergenceGuard(strategy, RobustPolicy(quarantine_rounds=1))
    assert guard.quarantine_devices(5, {"dev-00002", "dev-00000"}) == ["dev-00000", "dev-00002"]
    assert guard.quarantine_devices(5, []) == [] and len(guard.quarantine_log) == 1
    names = [[d.device_id for d in guard.available(fleet(3), r)] for r in (5, 6, 7)]
    assert names == [["dev-00001"], ["dev-00001"], ["dev-00000", "dev-00001", "dev-00002"]]
