"""profiler.fit: the one sizing rule (memory must fit, predicted training time must fit the deadline), its
reasons, and the speed correction fed by what boards really took."""

from __future__ import annotations

import pytest

from nestling.models.config import ModelConfig
from nestling.profiler.board_profile import emulated_board_profile
from nestling.profiler.catalogue import get_board
from nestling.profiler.estimator import estimate
from nestling.profiler.fit import (
    FALLBACK,
    MEMORY_BOUND,
    TIME_BOUND,
    UNCONSTRAINED,
    SpeedFeedback,
    fit_member,
)
from nestling.profiler.planner import member_for_budget
from nestling.spec import SubmodelSpec

MODEL = ModelConfig("resnet20", num_classes=10, in_channels=1, image_size=16)
SPECS = [SubmodelSpec(MODEL, width=w) for w in (1.0, 0.25, 0.5, 0.75)]  # not in size order on purpose
BATCH, SAMPLES = 32, 320
MEMORY = [estimate(s, BATCH).training_bytes for s in SPECS]


def board(name: str, memory: int = 2**34):
    return emulated_board_profile(
        SubmodelSpec.full(MODEL), BATCH, get_board(name).sustained_gflops, memory, name
    )


def seconds(name: str) -> list[float]:
    profile = board(name)
    return [profile.train_seconds(s, SAMPLES) for s in SPECS]


def test_memory_only_takes_the_largest_that_fits_as_the_planner_always_did() -> None:
    for budget in [MEMORY[1] - 1, MEMORY[1], MEMORY[2] + 1, MEMORY[3], MEMORY[0] * 2]:
        fit = fit_member(SPECS, BATCH, memory_budget=budget)
        assert fit.index == member_for_budget(SPECS, budget, BATCH)
    fit = fit_member(SPECS, BATCH, memory_budget=MEMORY[2] + 1)
    assert (fit.index, fit.reason, fit.predicted_s) == (2, MEMORY_BOUND, None)
    assert fit_member(SPECS, BATCH, memory_budget=MEMORY[1] - 1).reason == FALLBACK
    assert fit_member(SPECS, BATCH, memory_budget=MEMORY[0]).reason == UNCONSTRAINED


def test_time_only_takes_the_largest_predicted_to_train_within_the_deadline() -> None:
    times = seconds("rpi4")
    allowed = (times[2] + times[3]) / 2  # the 0.5-wide fits, the 0.75-wide does not
    fit = fit_member(
        SPECS, BATCH, memory_budget=None, board=board("rpi4"), samples=SAMPLES, time_budget_s=allowed
    )
    assert (fit.index, fit.reason) == (2, TIME_BOUND)
    assert fit.predicted_s == pytest.approx(times[2]) and fit.predicted_s <= allowed
    faster = fit_member(
        SPECS, BATCH, memory_budget=None, board=board("jetson-nano"), samples=SAMPLES, time_budget_s=allowed
    )
    assert (faster.index, faster.reason) == (0, UNCONSTRAINED)  # a faster board takes the full model


def test_both_limits_whichever_binds_first_names_the_reason() -> None:
    times = seconds("rpi4")
    roomy_time = times[0] * 2
    by_memory = fit_member(
        SPECS,
        BATCH,
        memory_budget=None,
        board=board("rpi4", MEMORY[3] - 1),
        samples=SAMPLES,
        time_budget_s=roomy_time,
    )
    assert (by_memory.index, by_memory.reason, by_memory.budget_bytes) == (2, MEMORY_BOUND, MEMORY[3] - 1)
    by_time = fit_member(
        SPECS,
        BATCH,
        memory_budget=None,
        board=board("rpi4", MEMORY[3] + 1),
        samples=SAMPLES,
        time_budget_s=times[1] * 1.01,
    )
    assert (by_time.index, by_time.reason) == (1, TIME_BOUND)
    hand_set = fit_member(  # a hand-set budget wins over what the board measured
        SPECS, BATCH, memory_budget=MEMORY[1], board=board("rpi4"), samples=SAMPLES, time_budget_s=roomy_time
    )
    assert (hand_set.index, hand_set.budget_bytes) == (1, MEMORY[1])
    nothing = fit_member(
        SPECS, BATCH, memory_budget=None, board=board("rpi4"), samples=SAMPLES, time_budget_s=times[1] / 2
    )
    assert (nothing.index, nothing.reason) == (1, FALLBACK)


def test_a_slower_speed_factor_sizes_down_and_growing_back_needs_headroom() -> None:
    times = seconds("rpi5")
    allowed = times[0] * 1.05  # the full model fits with 5 % to spare
    kwargs = dict(memory_budget=None, board=board("rpi5"), samples=SAMPLES, time_budget_s=allowed)
    assert fit_member(SPECS, BATCH, **kwargs).index == 0
    slowed = fit_member(SPECS, BATCH, speed=2.0, **kwargs)
    assert slowed.index != 0 and slowed.predicted_s == pytest.approx(2.0 * times[slowed.index])
    # Recovered: from a smaller submodel, the full one needs UPSIZE_HEADROOM (10 %) room; it has 5 %.
    assert fit_member(SPECS, BATCH, current=slowed.index, **kwargs).index != 0
    assert (
        fit_member(SPECS, BATCH, current=slowed.index, **{**kwargs, "time_budget_s": times[0] * 1.2}).index
        == 0
    )
    assert fit_member(SPECS, BATCH, current=0, **kwargs).index == 0  # staying put needs no headroom


def test_speed_feedback_is_an_ewma_of_observed_over_predicted() -> None:
    feedback = SpeedFeedback(alpha=0.5)
    assert feedback.factor("b") == 1.0
    assert feedback.observe("b", predicted_s=2.0, observed_s=4.0) == 2.0  # first observation: taken as is
    assert feedback.observe("b", predicted_s=2.0, observed_s=2.0) == pytest.approx(1.5)
    assert feedback.observe("b", predicted_s=2.0, observed_s=1.0, censored=True) == pytest.approx(1.5)
    assert feedback.observe("b", predicted_s=2.0, observed_s=6.0, censored=True) == pytest.approx(2.25)
    assert feedback.observe("b", predicted_s=0.0, observed_s=6.0) == pytest.approx(2.25)  # nothing to learn
