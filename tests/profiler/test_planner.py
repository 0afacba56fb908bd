"""Budgets → plans: largest fitting family member, k-means ScaleFL levels, FeDepth stages per device."""

from __future__ import annotations

import pytest

from nestling.models import ModelConfig
from nestling.profiler.decompose import full_model_costs, width_budget
from nestling.profiler.estimator import estimate
from nestling.profiler.planner import (
    DeviceBudget,
    assign_levels,
    cluster_budget_fractions,
    device_memory_budget,
    kmeans_1d,
    largest_fitting,
    member_for_budget,
    plan_depthwise,
    plan_family,
    scalefl_level_specs,
    scalefl_memory_levels,
)
from nestling.spec import SubmodelSpec

MIB = 2**20
MODEL = ModelConfig("resnet20", norm_stats="batch")
FAMILY = [SubmodelSpec(MODEL, width=w) for w in (0.25, 0.5, 0.75, 1.0)]


def test_each_device_gets_the_largest_member_that_fits() -> None:
    costs = [estimate(s, 32).training_bytes for s in FAMILY]
    assert largest_fitting(FAMILY, costs[2], 32) == 2
    assert largest_fitting(FAMILY, costs[2] - 1, 32) == 1
    assert largest_fitting(FAMILY, costs[0] - 1, 32) is None
    assert member_for_budget(FAMILY, costs[0] - 1, 32) == 0  # nothing fits: the cheapest still takes part
    devices = [
        DeviceBudget("small", costs[1] + 1),
        DeviceBudget("huge", 10 * costs[3]),
        DeviceBudget("tiny", 1),
    ]
    rows = plan_family(["a", "b", "c", "d"], FAMILY, devices, 32)
    assert [(r.label, r.fits) for r in rows] == [("b", True), ("d", True), ("a", False)]
    assert (
        rows[0].memory_bytes == costs[1]
        and rows[0].training_macs == estimate(FAMILY[1], 32).training_macs * 32
    )


def test_a_time_budget_also_bounds_the_choice() -> None:
    fast = DeviceBudget("fast", 10**12, gflops=100.0)
    step_full = fast.step_ms(estimate(FAMILY[3], 32).training_macs * 32)
    assert step_full == pytest.approx(2 * estimate(FAMILY[3], 32).training_macs * 32 / 100e9 * 1000)
    slow = DeviceBudget("slow", 10**12, gflops=100.0, step_ms_budget=step_full / 2)
    assert largest_fitting(FAMILY, slow.memory_bytes, 32, device=slow) < 3


def test_a_profiled_step_scales_by_training_macs() -> None:
    profile = {
        "name": "board",
        "device": {"memory": {"available_bytes": 1000 * MIB}, "compute": {"gflops": 5.0}},
        "model": {"spec": FAMILY[1].to_dict(), "batch": 32},
        "total": {"step_ms": {"median": 80.0}},
    }
    device = DeviceBudget.from_profile(profile, memory_fraction=0.25)
    assert device.memory_bytes == 250 * MIB and device.name == "board"
    reference = estimate(FAMILY[1], 32).training_macs * 32
    assert device.step_ms(2 * reference) == pytest.approx(160.0)
    assert DeviceBudget.from_profile({**profile, "budget": {"memory_bytes": 7}}).memory_bytes == 7
    assert device_memory_budget(None, {"budget": {"memory_bytes": 9}}) == 9
    assert device_memory_budget(5, {"budget": {"memory_bytes": 9}}) == 5
    assert device_memory_budget(None, None) is None


def test_kmeans_groups_budgets_and_orders_clusters() -> None:
    centres, labels = kmeans_1d([1, 2, 1.5, 10, 11, 30], 3)
    assert centres == pytest.approx([1.5, 10.5, 30.0])
    assert labels == [0, 0, 0, 1, 1, 2]
    assert kmeans_1d([4, 4, 4], 3)[1] == [0, 0, 0]  # fewer distinct values than clusters


def test_scalefl_levels_fit_the_smallest_budget_of_their_cluster_and_devices_their_level() -> None:
    """METHODS §6.b invariant 7: each client's level cost ≤ its budget."""
    model = ModelConfig(
        "resnet20", exit_kind="scalefl", scaler="always", norm_stats="batch", rounding="floor"
    )
    budgets = [8 * MIB, 9 * MIB, 15 * MIB, 16 * MIB, 40 * MIB]
    full = estimate(SubmodelSpec(model), 32).training_bytes
    fractions = cluster_budget_fractions(budgets, 3, full)
    assert fractions[-1] == 1.0 and fractions == sorted(fractions)
    levels = scalefl_memory_levels(model, [int(f * full) for f in fractions[:-1]], 32)
    assert [lv.depth for lv in levels] == sorted({lv.depth for lv in levels})  # each level ends deeper
    assert all(lv.memory_bytes <= lv.target_bytes for lv in levels)
    specs = scalefl_level_specs(model, levels)
    assert len(specs[-1].exits) == len(levels) and specs[-1].head
    rows = assign_levels(specs, [DeviceBudget(f"d{i}", b) for i, b in enumerate(budgets)], 32)
    for row, budget in zip(rows, budgets):
        assert row.fits and row.memory_bytes <= budget
    assert rows[0].label == "L1" and rows[-1].label != "L1"


def test_fedepth_rows_carry_each_devices_stages_within_its_budget() -> None:
    model = ModelConfig("preresnet20", norm_stats="batch")
    full = SubmodelSpec(model)
    costs = full_model_costs(full, 32)
    budgets = [width_budget(full, r, 32) for r in (1 / 8, 1 / 6, 1 / 2, 1.0)]
    rows = plan_depthwise(
        costs, estimate(full, 32), [DeviceBudget(f"d{i}", b, gflops=50.0) for i, b in enumerate(budgets)]
    )
    assert [len(r.detail["plan"]["stages"]) > 1 for r in rows] == [True, True, True, False]
    assert rows[0].detail["plan"]["bypass"] and not rows[1].detail["plan"]["bypass"]
    for row, budget in zip(rows, budgets):
        assert row.fits and row.memory_bytes <= budget * 1.05
        assert row.step_ms is not None and row.step_ms > 0
    hopeless = plan_depthwise(costs, estimate(full, 32), [DeviceBudget("none", 1000)])[0]
    assert not hopeless.fits and hopeless.label == "does not fit"


@pytest.mark.parametrize("method", ["nefl-wd", "heterofl"])
def test_strategies_assign_the_largest_submodel_a_registered_budget_holds(method: str) -> None:
    from nestling.server.strategies import DeviceInfo, StrategyContext, create_strategy

    ctx = StrategyContext(
        arch="resnet20",
        num_classes=10,
        in_channels=3,
        image_size=32,
        num_clients=10,
        total_rounds=5,
        local={"batch_size": 32},
    )
    strategy = create_strategy(method, ctx)
    family = (
        strategy.specs
        if isinstance(strategy.specs, list)
        else [strategy.specs[r] for r in sorted(strategy.specs)]
    )
    costs = [estimate(s, 32).training_bytes for s in family]
    for k in range(len(family)):
        # Index 0 would be the weakest tier by position: the budget decides instead. NeFL's flexible tiers
        # may still draw smaller submodels, never a larger one.
        device = DeviceInfo("board", 0, 10, memory_budget_bytes=costs[k] + 1)
        chosen = {strategy.spec_for(r, device).id for r in range(30)}
        assert family[k].id in chosen
        assert all(costs[[s.id for s in family].index(c)] <= costs[k] for c in chosen)
    profiled = DeviceInfo("board", 9, 10, profile={"budget": {"memory_bytes": costs[0] - 1}})
    assert strategy.spec_for(0, profiled).id == family[0].id  # nothing fits: the smallest still trains


def test_scalefl_level_search_by_bisection_picks_what_the_full_width_scan_picks() -> None:
    """The search estimates only the widths that bound each depth's window; the full scan estimates them all."""
    from nestling.profiler.planner import MemoryLevel

    model = ModelConfig("resnet20", exit_kind="scalefl", scaler="always", norm_stats="batch")
    full = estimate(SubmodelSpec(model), 32).training_bytes
    targets = [int(0.1 * full), int(0.3 * full)]
    blocks, widths = 9, [round(0.02 * i, 6) for i in range(1, 51)]
    scanned: list[MemoryLevel] = []
    for target in targets:
        exits = tuple(level.depth - 1 for level in scanned)
        fitting = []
        for depth in range((scanned[-1].depth if scanned else 0) + 1, blocks + 1):
            probe = model.with_(exit_points=(*exits, depth - 1))
            for width in widths:
                spec = SubmodelSpec(probe, width=width, depth=depth, exits=probe.exit_points, head=False)
                memory = estimate(spec, 32).training_bytes
                if memory > target:
                    break  # the scan the planner used to run: wider only costs more
                fitting.append(MemoryLevel(width, depth, memory, target))
        reach = max(level.memory_bytes for level in fitting)
        eligible = [level for level in fitting if level.memory_bytes >= 0.95 * reach]
        scanned.append(min(eligible, key=lambda lv: (abs(lv.width - lv.depth / blocks), -lv.memory_bytes)))
    assert scalefl_memory_levels(model, targets, 32) == scanned
