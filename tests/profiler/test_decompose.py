"""FeDepth's greedy decomposition (METHODS §3.a.2, §3.b invariants 1 and 7) and the width budgets R(r)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nestling.errors import ConfigError
from nestling.models import ModelConfig
from nestling.profiler.decompose import (
    PAPER_BLOCK_MB,
    PAPER_WIDTH_MB,
    StagePlan,
    depth_costs_from_profile,
    full_model_costs,
    greedy_stages,
    width_budget,
)
from nestling.profiler.estimator import training_memory
from nestling.profiler.measure import profile_model
from nestling.spec import SubmodelSpec


def blocks(*numbers: int) -> tuple[int, ...]:
    """Paper names B1..B9 → block indices 0..8."""
    return tuple(n - 1 for n in numbers)


@pytest.mark.parametrize(
    "ratio, stages, bypass",
    [
        (1 / 6, [blocks(1), blocks(2), blocks(3), blocks(4), blocks(5, 6), blocks(7, 8, 9)], ()),
        (1 / 3, [blocks(1, 2), blocks(3, 4), blocks(5, 6, 7, 8, 9)], ()),
        (1 / 2, [blocks(1, 2, 3), blocks(4, 5, 6, 7, 8, 9)], ()),
        (1.0, [blocks(1, 2, 3, 4, 5, 6, 7, 8, 9)], ()),
        (1 / 8, [blocks(4), blocks(5), blocks(6), blocks(7, 8), blocks(9)], blocks(1, 2, 3)),
    ],
)
def test_the_paper_table_gives_the_reference_stages(ratio: float, stages: list, bypass: tuple) -> None:
    plan = greedy_stages(PAPER_BLOCK_MB, PAPER_WIDTH_MB[ratio], 0.05)
    assert plan.stages == tuple(stages)
    assert plan.bypass == bypass


@pytest.mark.parametrize("tolerance", [0.042, 0.05, 0.1, 0.141])
def test_every_tolerance_in_the_reproducing_range_gives_the_same_stages(tolerance: float) -> None:
    """B5+B6 = 20.14 MB against R(1/6) = 19.34 MB needs τ ≥ 0.0414; B3+B4+B5 = 44.14 MB against R(1/3) needs
    τ < 0.1412 (METHODS §3.a.2 quotes 0.036 as the lower end: that one splits B5 from B6)."""
    reference = {r: greedy_stages(PAPER_BLOCK_MB, mb, 0.05) for r, mb in PAPER_WIDTH_MB.items()}
    for r, mb in PAPER_WIDTH_MB.items():
        assert greedy_stages(PAPER_BLOCK_MB, mb, tolerance) == reference[r]
    assert greedy_stages(PAPER_BLOCK_MB, PAPER_WIDTH_MB[1 / 6], 0.036).stages[4] == blocks(5)


@given(
    costs=st.lists(st.floats(0.5, 20.0), min_size=1, max_size=12),
    budget=st.floats(1.0, 60.0),
    stem=st.floats(0.0, 3.0),
    head=st.floats(0.0, 3.0),
)
def test_stages_are_contiguous_ordered_and_each_fits(
    costs: list[float], budget: float, stem: float, head: float
) -> None:
    ends = [head] * (len(costs) + 1)
    try:
        plan = greedy_stages(costs, budget, 0.05, stem_cost=stem, end_costs=ends)
    except ConfigError:
        return  # some block that is not an input-side prefix cannot fit, or nothing fits at all
    trained = [b for stage in plan.stages for b in stage]
    assert list(plan.bypass) + trained == list(range(len(costs)))  # every block once, in order
    assert all(stage for stage in plan.stages[1:])  # only the first stage may hold the stem alone
    for j, stage in enumerate(plan.stages):
        cost = (stem if j == 0 else 0.0) + sum(costs[b] for b in stage) + head
        assert cost <= budget * 1.05 + 1e-9  # invariant 7 on the table
    for b in plan.bypass:
        assert costs[b] + head > budget * 1.05


def test_an_unfittable_block_after_a_trained_one_is_an_error() -> None:
    with pytest.raises(ConfigError, match="only an input-side prefix"):
        greedy_stages([1.0, 5.0, 1.0], 2.0)


def test_a_stem_too_large_to_train_alone_is_an_error() -> None:
    with pytest.raises(ConfigError, match="stem"):
        greedy_stages([3.0, 3.0], 4.0, 0.0, stem_cost=3.0, end_costs=[1.5, 0.5, 0.5])


def test_the_stem_gets_a_stage_of_its_own_when_it_cannot_join_the_first_block() -> None:
    plan = greedy_stages([3.0, 3.0], 4.0, 0.0, stem_cost=2.0, end_costs=[1.0, 1.0, 1.0])
    assert plan.stages == ((), (0,), (1,))
    assert plan.describe() == "[stem] [B1] [B2]"


def test_stage_plans_round_trip_and_reject_overlaps() -> None:
    plan = StagePlan(((), (3,), (4, 5)), (0, 1, 2))
    assert StagePlan.from_dict(plan.to_dict()) == plan
    for bad in (
        {"stages": [[0, 1], [1, 2]]},
        {"stages": [[2], [0, 1]]},
        {"stages": [[0]], "bypass": [3]},
        {"stages": []},
        {"stage": [[0]]},
    ):
        with pytest.raises(ConfigError):
            StagePlan.from_dict(bad)


def test_width_budgets_are_the_training_memory_of_the_narrow_model(preresnet20: ModelConfig) -> None:
    full = SubmodelSpec(preresnet20)
    assert width_budget(full, 1 / 6, 32) == training_memory(SubmodelSpec(preresnet20, width=1 / 6), 32)
    assert width_budget(full, 2.0, 32) == 2 * training_memory(full, 32)
    with pytest.raises(ConfigError):
        width_budget(full, 0.0, 32)


def test_measured_and_estimated_cost_tables_agree(preresnet20: ModelConfig) -> None:
    full = SubmodelSpec(preresnet20)
    measured = depth_costs_from_profile(profile_model(full, 8, repeats=1, warmup=0, rss_check=False))
    estimated = full_model_costs(full, 8)
    assert measured.blocks == pytest.approx(estimated.blocks, rel=1e-6)
    assert measured.stem == pytest.approx(estimated.stem, rel=1e-6)
    assert measured.ends == pytest.approx(estimated.ends, rel=1e-6)


def test_one_sixth_of_preresnet20_trains_the_full_model_in_the_papers_stage_order(
    preresnet20: ModelConfig,
) -> None:
    """At the paper's batch (128) our own per-block table yields the paper's order; the stem, which the paper's
    table leaves out, gets a stage of its own."""
    full = SubmodelSpec(preresnet20)
    costs = full_model_costs(full, 128)
    plan = costs.plan(width_budget(full, 1 / 6, 128))
    assert plan.stages == ((), blocks(1), blocks(2), blocks(3), blocks(4), blocks(5, 6), blocks(7, 8, 9))
    lack = costs.plan(width_budget(full, 1 / 8, 128))
    assert lack.bypass == blocks(1, 2, 3)
