"""Every method that sizes work by device plans from measured profiles (profiler/fit.py through
Strategy.fit_by_budget), and sizes exactly as before when no board sent one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nestling.errors import ConfigError
from nestling.profiler.board_profile import emulated_board_profile
from nestling.profiler.catalogue import get_board
from nestling.profiler.estimator import estimate
from nestling.profiler.fit import PINNED, TIME_BOUND
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.server.strategies.base import DeviceInfo

CLASSES = ("jetson-nano", "rpi5", "phone-low", "rpi4")  # fastest first
SAMPLES = 200


def context(deadline_s: float | None) -> StrategyContext:
    return StrategyContext(
        arch="resnet20",
        num_classes=10,
        in_channels=1,
        image_size=16,
        num_clients=4,
        total_rounds=2,
        local={"batch_size": 32, "local_epochs": 1},
        options={},
        deadline_s=deadline_s,
    )


def fleet(strategy, memory: int | None = None) -> list[DeviceInfo]:
    """Four boards registered slowest first (index order says nothing about speed)."""
    devices = []
    for index, name in enumerate(reversed(CLASSES)):
        board = get_board(name)
        profile = emulated_board_profile(
            strategy.full_spec, 32, board.sustained_gflops, memory or board.memory_budget_bytes, name
        )
        devices.append(DeviceInfo(name, index, SAMPLES, profile={}, board=profile))
    return devices


def deadline_for(strategy) -> float:
    """A deadline the fastest class meets with the full model and the slowest cannot."""
    nano = fleet(strategy)[-1].board
    assert nano is not None
    return 1.2 * nano.train_seconds(strategy.full_spec, SAMPLES) / strategy.ctx.train_share


@pytest.mark.parametrize("method", ["nefl-wd", "heterofl", "fjord", "scalefl", "depthfl"])
def test_slower_boards_get_smaller_submodels_and_each_plan_says_why(method: str) -> None:
    probe = create_strategy(method, context(None))
    strategy = create_strategy(method, context(deadline_for(probe)))
    devices = fleet(strategy)
    tasks = strategy.assign(0, devices)
    plans, replans = strategy.plan_report(0, devices, tasks)
    memory = {d.device_id: estimate(strategy.spec_for(0, d), 32).training_bytes for d in devices}
    by_speed = [memory[name] for name in CLASSES]
    assert by_speed == sorted(by_speed, reverse=True) and len(set(by_speed)) >= 2, by_speed
    assert plans["rpi4"]["reason"] in (TIME_BOUND, "fallback") and replans == []
    for name in CLASSES:
        plan = plans[name]
        assert plan["spec"] == tasks[name].spec_id and plan["source"] == f"emulated:{name}"
        if plan["reason"] != "fallback":
            assert plan["predicted_s"] <= strategy.time_budget_s + 1e-9


@pytest.mark.parametrize("method", ["nefl-wd", "heterofl", "fjord", "scalefl", "depthfl", "fedepth"])
def test_without_profiles_every_method_sizes_exactly_as_before(method: str) -> None:
    strategy = create_strategy(method, context(10.0))
    plain = [replace(d, board=None) for d in fleet(strategy)]
    budgeted = [replace(d, memory_budget_bytes=12 * 2**20) for d in plain]
    for devices in (plain, budgeted):
        reference = create_strategy(method, context(None))
        assert [strategy.spec_for(0, d).id for d in devices] == [reference.spec_for(0, d).id for d in devices]
        assert strategy.plan_report(0, devices, strategy.assign(0, devices)) == ({}, [])


def test_a_hand_set_budget_wins_over_measured_memory_and_a_pinned_tier_over_both() -> None:
    strategy = create_strategy("nefl-wd", context(None))
    fast = fleet(strategy)[-1]
    assert strategy.tier_of(fast) == len(strategy.specs) - 1  # its measured memory holds the full model
    budget = estimate(strategy.specs[1], 32).training_bytes
    assert strategy.tier_of(replace(fast, memory_budget_bytes=budget)) == 1
    pinned = replace(fast, tier=0)  # pinned by the enrolment
    assert strategy.tier_of(pinned) == 0
    assert strategy.tier_of(replace(pinned, memory_budget_bytes=10**12)) == 0  # whatever budget it claims
    tasks = strategy.assign(0, [pinned])
    plans, _ = strategy.plan_report(0, [pinned], tasks)
    assert plans[pinned.device_id]["reason"] == PINNED


def test_fedepth_decomposes_by_the_memory_a_board_measured() -> None:
    strategy = create_strategy("fedepth", context(None))
    roomy, tight = fleet(strategy)[-1], fleet(strategy, memory=12 * 2**20)[-1]
    stages_roomy = strategy.local_hparams(0, roomy, strategy.spec_for(0, roomy))["plan"]
    stages_tight = strategy.local_hparams(0, tight, strategy.spec_for(0, tight))["plan"]
    assert len(stages_tight["stages"]) > len(stages_roomy["stages"])
    plans, _ = strategy.plan_report(0, [tight], strategy.assign(0, [tight]))
    assert plans[tight.device_id]["reason"] == "decomposed by memory"
    assert plans[tight.device_id]["budget_bytes"] == 12 * 2**20


def test_the_planning_state_a_checkpoint_keeps_round_trips_and_bad_values_are_named() -> None:
    strategy = create_strategy("nefl-wd", context(None))
    devices = fleet(strategy)
    strategy.feedback.observe(devices[0].device_id, 1.0, 2.5)
    strategy.plan_report(
        0, devices, strategy.assign(0, devices)
    )  # nothing sized without a deadline: no choices
    state = strategy.planning_state()
    restored = create_strategy("nefl-wd", context(None))
    restored.load_planning_state(state)
    assert restored.planning_state() == state and restored.feedback.factor(devices[0].device_id) == 2.5
    restored.load_planning_state({})  # a checkpoint written before the closed loop
    assert restored.feedback.factors == {}
    with pytest.raises(ConfigError, match="planning.speed"):
        restored.load_planning_state({"speed": {"a": -1.0}})
    with pytest.raises(ConfigError, match="planning.chosen"):
        restored.load_planning_state({"speed": {}, "chosen": {"a": 3}})
