"""ScaleFL (METHODS §6): width × depth levels found by grid search, early exits, gradient-aware count averaging."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from nestling.errors import ConfigError
from nestling.models import ModelConfig, build, kept_channels
from nestling.models.cost import count_parameters
from nestling.server.strategies import DeviceInfo, StrategyContext, create_strategy
from nestling.server.strategies.scalefl import ScaleFL
from nestling.server.strategies.scalefl_split import Level, _group_params, level_budgets, search_levels
from nestling.slicing import shapes_for
from nestling.spec import SubmodelSpec

NUM_BLOCKS = 9
BASE = ModelConfig(
    "resnet20",
    num_classes=4,
    image_size=8,
    exit_kind="scalefl",
    scaler="always",
    norm_stats="batch",
    rounding="floor",
)


def context(**overrides) -> StrategyContext:
    values = {
        "arch": "resnet20",
        "num_classes": 4,
        "in_channels": 3,
        "image_size": 8,
        "num_clients": 8,
        "total_rounds": 8,
    }
    values.update(overrides)
    return StrategyContext(**values)


@pytest.fixture(scope="module")
def scalefl() -> ScaleFL:
    strategy = create_strategy("scalefl", context())
    assert isinstance(strategy, ScaleFL)
    return strategy


def fresh(strategy: ScaleFL) -> ScaleFL:
    """A new strategy with the same levels (the grid search is cached), so tests can aggregate freely."""
    return create_strategy("scalefl", strategy.ctx)  # type: ignore[return-value]


def devices(n: int = 8) -> list[DeviceInfo]:
    return [DeviceInfo(f"dev-{i:05d}", i, 10) for i in range(n)]


@functools.cache
def params(spec: SubmodelSpec) -> int:
    return count_parameters(build(spec, device="meta"))


# -- §6.b.1 ------------------------------------------------------------------------------------------
def test_split_with_both_ratios_one_is_the_model_itself() -> None:
    strategy = create_strategy("scalefl", context(options={"levels": (1.0,)}))
    (spec,) = strategy.specs
    assert spec == SubmodelSpec.full(strategy.model)
    assert params(spec) == count_parameters(build(SubmodelSpec.full(strategy.model)))
    assert search_levels(BASE, (1.0,), num_blocks=NUM_BLOCKS)[0].width == 1.0


def test_level_models_floor_every_hidden_width_and_never_slice_rgb_or_classes(scalefl: ScaleFL) -> None:
    for level, spec in zip(scalefl.levels, scalefl.specs):
        net = build(spec, device="meta")
        state = net.state_dict()
        assert state["stem.conv.weight"].shape == (int(16 * level.width), 3, 3, 3)
        for index, block in enumerate(net.blocks):
            expected = int(np.floor(round(net.infos[index].global_out * level.width, 9)))
            assert block.conv1.weight.shape[0] == expected, (level, index)
        for key, value in state.items():
            if key.endswith("fc.weight"):
                assert value.shape[0] == 4
        assert spec.model.rounding == "floor" and kept_channels(64, 0.7, "floor") == 44


# -- §6.b.4 ------------------------------------------------------------------------------------------
def test_level_l_model_returns_exactly_l_predictions(scalefl: ScaleFL) -> None:
    torch.manual_seed(0)
    for l, spec in enumerate(scalefl.specs, start=1):
        net = build(spec)
        outputs = net.forward_all(torch.randn(2, 3, 8, 8))
        assert len(outputs) == l and all(o.shape == (2, 4) for o in outputs)


def test_levels_are_nested_in_depth_and_carry_the_earlier_exits(scalefl: ScaleFL) -> None:
    depths = [level.depth for level in scalefl.levels]
    assert depths == sorted(depths) and len(set(depths)) == len(depths) and depths[-1] == NUM_BLOCKS
    assert scalefl.model.exit_points == tuple(d - 1 for d in depths[:-1])
    for l, spec in enumerate(scalefl.specs[:-1]):
        assert spec.depth == depths[l] and spec.exits == scalefl.model.exit_points[: l + 1] and not spec.head


# -- §6.b.6 ------------------------------------------------------------------------------------------
def test_each_level_reaches_its_cost_target_within_tolerance(scalefl: ScaleFL) -> None:
    """Cost = parameters of the level's model (with its exits) over the full model with those exits."""
    fractions = scalefl.options.levels
    for l, (level, spec) in enumerate(zip(scalefl.levels[:-1], scalefl.specs)):
        full = SubmodelSpec(scalefl.model, exits=spec.exits)
        ratio = params(spec) / params(full)
        assert ratio == pytest.approx(level.cost_ratio, rel=1e-9)
        assert abs(ratio / fractions[l] - 1) <= 0.05


def test_grid_search_returns_the_most_balanced_feasible_split() -> None:
    """Brute force on a coarse grid, costing each candidate by counting the built model's parameters."""
    step, tolerance, fractions = 0.1, 0.05, (0.25, 0.5, 1.0)
    levels = search_levels(BASE, fractions, num_blocks=NUM_BLOCKS, step=step, tolerance=tolerance)
    grid = [round(step * i, 4) for i in range(1, 11)]
    chosen: list[int] = []
    for fraction, level in zip(fractions[:-1], levels):
        model = BASE.with_(exit_points=tuple(range(NUM_BLOCKS)))
        best = None
        for width in grid:
            for ratio in grid:
                depth = int(np.floor(ratio * NUM_BLOCKS + 1e-9))
                if depth < 1 or (chosen and depth - 1 <= chosen[-1]):
                    continue
                exits = (*chosen, depth - 1)
                cost = params(SubmodelSpec(model, width=width, depth=depth, exits=exits, head=False))
                full = params(SubmodelSpec(model, exits=exits))
                if abs(cost / (fraction * full) - 1) <= tolerance:
                    best = min(best if best is not None else 9.0, abs(width - ratio))
        assert best is not None
        balance = min(
            abs(level.width - r) for r in grid if int(np.floor(r * NUM_BLOCKS + 1e-9)) == level.depth
        )
        assert balance == pytest.approx(best), (fraction, level)
        assert abs(level.cost_ratio / fraction - 1) <= tolerance
        chosen.append(level.depth - 1)


def test_cost_grows_with_width_and_with_depth() -> None:
    model = BASE.with_(exit_points=tuple(range(NUM_BLOCKS)))
    costs = np.array(
        [
            [
                params(SubmodelSpec(model, width=w, depth=d, exits=(d - 1,), head=False))
                for d in range(1, NUM_BLOCKS + 1)
            ]
            for w in (0.25, 0.5, 0.75, 1.0)
        ]
    )
    assert (np.diff(costs, axis=0) > 0).all()
    # Deeper level: more blocks, and an exit head at a wider stage; never cheaper.
    assert (np.diff(costs, axis=1) >= 0).all()


def test_impossible_level_lists_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="must rise to 1.0"):
        create_strategy("scalefl", context(options={"levels": (0.5, 0.25, 1.0)}))
    with pytest.raises(ConfigError, match="too few blocks"):
        # tinycnn has 2 blocks: three early-exit levels cannot each end at a distinct block.
        create_strategy("scalefl", context(arch="tinycnn"))


# -- assignment --------------------------------------------------------------------------------------
def test_levels_take_equal_shares_of_a_seeded_client_permutation(scalefl: ScaleFL) -> None:
    counts = np.bincount([scalefl.specs.index(scalefl.spec_for(0, d)) for d in devices()], minlength=4)
    assert counts.tolist() == [2, 2, 2, 2]
    again = fresh(scalefl)
    assert [again.spec_for(3, d) for d in devices()] == [scalefl.spec_for(0, d) for d in devices()]
    task = scalefl.assign(0, devices(1))["dev-00000"]
    assert (
        task.procedure == "scalefl-sd"
        and task.hparams["kd_temperature"] == 3.0
        and task.hparams["kd_gamma"] == 0.0
    )


def test_blocks_assignment_gives_contiguous_client_blocks_smallest_level_first(scalefl: ScaleFL) -> None:
    blocks = create_strategy("scalefl", context(options={"assign": "blocks"}))
    assert isinstance(blocks, ScaleFL)
    assert [blocks.specs.index(blocks.spec_for(0, d)) for d in devices()] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ConfigError, match="ScaleFL assign must be 'shuffled' or 'blocks', got 'random'"):
        create_strategy("scalefl", context(options={"assign": "random"}))


# -- §6.b.2, §6.b.3, gradient-aware counts ------------------------------------------------------------------
def test_all_clients_at_the_top_level_aggregate_to_uniform_fedavg(scalefl: ScaleFL, fake_result) -> None:
    strategy = fresh(scalefl)
    top = [d for d in devices() if strategy.spec_for(0, d) == strategy.specs[-1]]
    tasks = list(strategy.assign(0, top).values())
    results = [fake_result(t, seed=i, num_samples=3 + 40 * i) for i, t in enumerate(tasks)]
    strategy.aggregate(0, list(zip(tasks, results)))
    for key, value in strategy.global_state.items():
        if value.is_floating_point():
            torch.testing.assert_close(value, torch.stack([r.weights[key] for r in results]).mean(0), msg=key)


def test_layers_deeper_than_a_levels_exit_are_untouched_by_its_clients(scalefl: ScaleFL, fake_result) -> None:
    strategy = fresh(scalefl)
    lowest = [d for d in devices() if strategy.spec_for(0, d) == strategy.specs[0]]
    before = {k: v.clone() for k, v in strategy.global_state.items()}
    tasks = list(strategy.assign(0, lowest).values())
    strategy.aggregate(0, [(t, fake_result(t, seed=i)) for i, t in enumerate(tasks)])
    depth, own_exit = strategy.levels[0].depth, str(strategy.model.exit_points[0])
    for key, value in strategy.global_state.items():
        parts = key.split(".")
        deeper = (parts[0] == "blocks" and int(parts[1]) >= depth) or (
            parts[0] == "exits" and parts[1] != own_exit
        )
        if deeper or parts[0] == "head":
            assert torch.equal(value, before[key]), key


def test_tensors_that_received_no_gradient_are_not_counted(scalefl: ScaleFL, fake_result) -> None:
    strategy = fresh(scalefl)
    top = [d for d in devices() if strategy.spec_for(0, d) == strategy.specs[-1]]
    a_task, b_task = strategy.assign(0, top).values()
    a = fake_result(
        a_task, seed=1, drop=("blocks.0.step", "head.fc.bias")
    )  # a's upload lacks untouched tensors
    b = fake_result(b_task, seed=2)
    before = strategy.global_state["head.fc.bias"].clone()
    strategy.aggregate(0, [(a_task, a), (b_task, b)])
    torch.testing.assert_close(strategy.global_state["blocks.0.step"], b.weights["blocks.0.step"])
    torch.testing.assert_close(strategy.global_state["head.fc.bias"], b.weights["head.fc.bias"])
    assert not torch.equal(strategy.global_state["head.fc.bias"], before)
    strategy.validate(a_task, a)  # a partial upload is valid


def test_registered_budgets_pick_the_largest_level_that_fits() -> None:
    """§6.a.1 / §6.b.7: each client's level cost (training memory here) ≤ its budget; none fits → cheapest."""
    from nestling.profiler.estimator import estimate
    from nestling.server.strategies import StrategyContext, create_strategy
    from nestling.server.strategies.base import DeviceInfo

    ctx = StrategyContext(
        arch="resnet20",
        num_classes=10,
        in_channels=3,
        image_size=32,
        num_clients=4,
        total_rounds=4,
        local={"batch_size": 16},
    )
    strategy = create_strategy("scalefl", ctx)
    costs = [estimate(spec, 16).training_bytes for spec in strategy.specs]
    assert costs == sorted(costs)
    for level, cost in enumerate(costs):
        device = DeviceInfo("dev-00000", 0, 10, memory_budget_bytes=cost + 1)
        assert strategy.specs.index(strategy.spec_for(0, device)) == level
    tiny = DeviceInfo("dev-00001", 1, 10, memory_budget_bytes=1)
    assert strategy.spec_for(0, tiny) == strategy.specs[0]


class TestLevelsFromThePlanner:
    """`nestling plan --method scalefl` clusters measured budgets into levels; the strategy trains exactly those."""

    def test_strategy_given_the_plans_grid_has_the_plans_level_specs(self) -> None:
        from nestling.profiler.planner import DeviceBudget
        from nestling.server.plan_methods import plan_rows

        mb = 1024 * 1024
        devices = [DeviceBudget(f"d{i}", int(m * mb)) for i, m in enumerate((1.5, 2, 3, 4, 6, 9, 40))]
        rows, extra = plan_rows("scalefl", "resnet20", devices, batch=8, shape=(3, 8, 8), classes=4, levels=3)
        grid = extra["strategy_options"]["grid"]
        assert grid and all(len(pair) == 2 for pair in grid)
        strategy = create_strategy("scalefl", context(options={"grid": grid}))
        assert [[lv.width, lv.depth] for lv in strategy.levels[:-1]] == grid
        planned = {SubmodelSpec.from_dict(row.spec).id for row in rows if row.spec is not None}
        assert planned <= {spec.id for spec in strategy.specs}
        assert strategy.specs[-1].width == 1.0 and strategy.specs[-1].head

    @pytest.mark.parametrize(
        ("grid", "message"),
        [
            ([[0.5, 10]], "depth must be an integer in \\[1, 9\\]"),
            ([[0.5, 4], [0.6, 3]], "depths must rise"),
            ([[1.5, 4]], "width must be in \\(0, 1\\]"),
            ([0.5], "\\[width, depth\\] pairs"),
            ([], "must be a list"),
        ],
    )
    def test_bad_grids_are_refused_by_name(self, grid: object, message: str) -> None:
        with pytest.raises(ConfigError, match=message):
            create_strategy("scalefl", context(options={"grid": grid}))


# -- the parameter accounting behind docs/reproductions.md's ScaleFL analysis -----------------------------
def test_level_budgets_split_each_level_model_into_backbone_and_exits(scalefl: ScaleFL) -> None:
    budgets = level_budgets(scalefl.model, scalefl.levels, num_blocks=NUM_BLOCKS)
    assert [b.level for b in budgets] == scalefl.levels[:-1]
    for budget, spec in zip(budgets, scalefl.specs):
        named = dict(build(spec, device="meta").named_parameters())
        exits = sum(p.numel() for name, p in named.items() if name.startswith("exits."))
        assert (budget.backbone, budget.exits) == (params(spec) - exits, exits)
        assert 0 < budget.exit_share < 1


def test_exit_heads_take_a_larger_share_of_a_level_on_a_shallow_resnet() -> None:
    """Why ScaleFL's small levels keep less backbone than a width-only model on ResNet-20 but not on ResNet-110:
    the same splits (the poster's depth ratios 0.66 / 0.77 / 0.88 at widths 0.7 / 0.7 / 0.75) in both."""
    shares = {}
    for arch, blocks in (("resnet20", 9), ("resnet110", 54)):
        model = BASE.with_(arch=arch, num_classes=10, image_size=32)
        levels = [
            Level(w, int(d * blocks), float("nan")) for w, d in ((0.7, 0.66), (0.7, 0.77), (0.75, 0.88))
        ]
        shares[arch] = [b.exit_share for b in level_budgets(model, [*levels, levels[-1]], num_blocks=blocks)]
    assert all(shallow > 2 * deep for shallow, deep in zip(shares["resnet20"], shares["resnet110"]))
    assert min(shares["resnet20"]) > 0.25 and max(shares["resnet110"]) < 0.25


@pytest.mark.parametrize("width", [0.33, 0.5, 1.0])
def test_group_params_sharing_one_exit_per_channel_count_matches_building_every_exit(width: float) -> None:
    probe = BASE.with_(exit_points=tuple(range(NUM_BLOCKS)))
    stem, blocks, exits, head = _group_params(probe, width)
    every = shapes_for(SubmodelSpec(probe, width=width, exits=probe.exit_points))
    counted = {key: float(np.prod(shape)) if shape else 1.0 for key, shape in every.items()}
    for block in range(NUM_BLOCKS):
        assert exits[block] == sum(n for k, n in counted.items() if k.startswith(f"exits.{block}."))
        assert blocks[block] == sum(n for k, n in counted.items() if k.startswith(f"blocks.{block}."))
    assert stem + head + sum(blocks) + sum(exits) == sum(counted.values())
