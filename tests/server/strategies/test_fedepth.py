"""FeDepth / m-FeDepth strategies: budget presets → stage plans, FedAvg aggregation, aux heads, end to end
(METHODS §3.a.1, 3.a.6–3.a.8; invariants §3.b 4 and 7)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nestling.config import config_from_dict
from nestling.edge.procedures import ClientData, DeviceStore
from nestling.edge.trainer import run_task
from nestling.errors import ConfigError
from nestling.profiler.decompose import StagePlan
from nestling.server.strategies import DeviceInfo, StrategyContext, create_strategy
from nestling.server.strategies.fedepth import BUDGET_PRESETS
from nestling.spec import SubmodelSpec

torch.set_num_threads(1)


def cifar_ctx(**options) -> StrategyContext:
    return StrategyContext(
        arch="preresnet20",
        num_classes=10,
        in_channels=3,
        image_size=32,
        num_clients=8,
        total_rounds=10,
        local={"batch_size": 32, "momentum": 0.9},
        options=options,
    )


def devices(n: int = 8) -> list[DeviceInfo]:
    return [DeviceInfo(f"dev-{i:05d}", i, 10 * (i + 1)) for i in range(n)]


def plans(strategy) -> list[tuple[StagePlan, int]]:
    tasks = strategy.assign(0, devices())
    return [(StagePlan.from_dict(t.hparams["plan"]), t.hparams["models"]) for t in tasks.values()]


def test_fair_budgets_give_quarter_tiers_depth_wise_plans_and_one_stage_at_full_width() -> None:
    strategy = create_strategy("fedepth", cifar_ctx())
    assert strategy.ratios == BUDGET_PRESETS["fair"] and strategy.model.norm_stats == "batch"
    by_device = plans(strategy)
    stages = [plan.num_stages for plan, _ in by_device]
    assert (
        stages[0] == stages[1] > stages[2] == stages[3] > stages[4] == stages[5] > stages[6] == stages[7] == 1
    )
    assert all(not plan.bypass and models == 1 for plan, models in by_device)
    task = strategy.assign(0, devices(1))["dev-00000"]
    assert (
        task.procedure == "fedepth" and task.spec_id == strategy.full_spec.id
    )  # everyone trains the full model
    assert task.hparams["variant"] == "skip" and task.hparams["tier"] == 0


def test_lack_bypasses_an_input_side_prefix_and_surplus_clients_train_two_models() -> None:
    lack = plans(create_strategy("fedepth", cifar_ctx(budgets="lack")))
    assert lack[0][0].bypass and not lack[2][0].bypass
    surplus = plans(create_strategy("m-fedepth", cifar_ctx()))
    assert [models for _, models in surplus] == [1, 1, 1, 1, 1, 1, 2, 2]
    assert surplus[7][0].num_stages == 1
    depthwise = plans(create_strategy("m-fedepth", cifar_ctx(budgets="fair", mutual_depthwise=True)))
    assert depthwise[7][1] == 2 and depthwise[7][0].num_stages > 1  # R(1) holds two models stage by stage


@pytest.mark.parametrize("plan", ["memory", "paper"])
def test_m_fedepth_says_when_no_board_can_distil(plan: str, caplog: pytest.LogCaptureFixture) -> None:
    """Fair budgets hold one full model at most: without mutual_depthwise m-FeDepth is FeDepth, and says so."""
    with caplog.at_level("WARNING", logger="nestling.server.strategies.fedepth"):
        strategy = create_strategy("m-fedepth", cifar_ctx(budgets="fair", plan=plan))
    assert all(models == 1 for _, models in plans(strategy))
    assert "no board distils and this run is FeDepth" in caplog.text and "mutual_depthwise" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="nestling.server.strategies.fedepth"):
        create_strategy("m-fedepth", cifar_ctx(budgets="fair", plan=plan, mutual_depthwise=True))
        create_strategy("m-fedepth", cifar_ctx(plan=plan))  # surplus: the ×2 tier holds two
    assert "no board distils" not in caplog.text


@pytest.mark.parametrize("budgets", sorted(BUDGET_PRESETS))
def test_every_stage_of_every_preset_fits_its_budget_by_the_cost_table(budgets: str) -> None:
    """Invariant 7 (on the per-block table)."""
    strategy = create_strategy("m-fedepth", cifar_ctx(budgets=budgets))
    for ratio, budget in strategy.ratio_bytes.items():
        plan, models = strategy.plan_for_budget(budget)
        assert max(strategy.costs.stage_bytes(plan)) * models <= budget * 1.05, ratio


def b(*numbers: int) -> tuple[int, ...]:
    """Paper names B1..B9 → block indices 0..8."""
    return tuple(n - 1 for n in numbers)


# METHODS §3.a.2 test vectors: the reference's hard-coded PreResNet-20 stages, per width ratio.
PAPER_STAGES = {
    1 / 8: StagePlan((b(4), b(5), b(6), b(7, 8), b(9)), bypass=b(1, 2, 3)),
    1 / 6: StagePlan((b(1), b(2), b(3), b(4), b(5, 6), b(7, 8, 9))),
    1 / 3: StagePlan((b(1, 2), b(3, 4), b(5, 6, 7, 8, 9))),
    1 / 2: StagePlan((b(1, 2, 3), b(4, 5, 6, 7, 8, 9))),
    1.0: StagePlan((b(1, 2, 3, 4, 5, 6, 7, 8, 9),)),
}


@pytest.mark.parametrize(
    "method, budgets", [("fedepth", "fair"), ("fedepth", "lack"), ("m-fedepth", "surplus")]
)
def test_the_paper_plan_assigns_the_papers_stages_for_every_preset_ratio(method: str, budgets: str) -> None:
    """`plan = "paper"`: what the strategy hands each tier (not the table alone) is METHODS' stage list;
    surplus ×2 trains two full models (§3.a.7)."""
    strategy = create_strategy(method, cifar_ctx(budgets=budgets, plan="paper"))
    tasks = strategy.assign(0, devices())
    for device in devices():
        ratio = strategy.ratios[strategy.tier_of(device)]
        hp = tasks[device.device_id].hparams
        expected = (PAPER_STAGES[1.0], 2) if ratio == 2.0 else (PAPER_STAGES[ratio], 1)
        assert (StagePlan.from_dict(hp["plan"]), hp["models"]) == expected, (budgets, ratio)


def assert_a_decomposition_of_the_body(plan: StagePlan, blocks: int = 9) -> None:
    """Invariant 1 on a real plan: every block bypassed or in exactly one stage, stages contiguous and ordered,
    bypassed blocks only an input-side prefix."""
    trained = [block for stage in plan.stages for block in stage]
    assert list(plan.bypass) + trained == list(range(blocks)), plan.describe()
    assert list(plan.bypass) == list(range(len(plan.bypass)))
    for stage in plan.stages:
        assert list(stage) == list(range(stage[0], stage[0] + len(stage))) if stage else True


@pytest.mark.parametrize("budgets", sorted(BUDGET_PRESETS))
@pytest.mark.parametrize("batch", [32, 128])
def test_the_memory_plans_of_every_preset_ratio_decompose_the_body_within_budget(
    budgets: str, batch: int
) -> None:
    """The default plans, as the strategy assigns them at the small-scale and the paper's batch: a decomposition
    of the body whose every stage fits R(r) by the run's own table (invariants 1 and 7); only the smallest
    budget bypasses anything, and only the full budget (or more) trains in one stage."""
    ctx = cifar_ctx(budgets=budgets)
    ctx.local["batch_size"] = batch
    strategy = create_strategy("m-fedepth" if budgets == "surplus" else "fedepth", ctx)
    for device in devices():
        ratio = strategy.ratios[strategy.tier_of(device)]
        plan, models = strategy.plan_for(device)
        assert_a_decomposition_of_the_body(plan)
        assert max(strategy.costs.stage_bytes(plan)) * models <= strategy.ratio_bytes[ratio] * 1.05
        assert bool(plan.bypass) == (ratio < 1 / 7)
        assert (plan.num_stages == 1) == (ratio >= 1.0)


def test_the_paper_plans_are_decompositions_too_but_exceed_the_measured_budgets() -> None:
    """Why the memory plan stays the default (docs/methods-decisions.md): the paper's table leaves the stem
    and head out, so its stages need more than R(r) by the run's own table below ×1."""
    strategy = create_strategy("fedepth", cifar_ctx(budgets=[1 / 8, 1 / 6, 1 / 3, 1 / 2, 1.0], plan="paper"))
    for ratio, budget in strategy.ratio_bytes.items():
        plan, _ = strategy.paper_plan_for(ratio)
        assert_a_decomposition_of_the_body(plan)
        excess = max(strategy.costs.stage_bytes(plan)) / budget
        assert excess > 1.05 if ratio < 1 else excess == pytest.approx(1.0), ratio


def test_the_paper_plan_maps_a_registered_budget_to_the_largest_paper_budget_it_holds() -> None:
    strategy = create_strategy("m-fedepth", cifar_ctx(plan="paper"))
    third = strategy.ratio_bytes[1 / 3]
    assert strategy.plan_for(DeviceInfo("a", 0, 10, memory_budget_bytes=third + 10))[0] == PAPER_STAGES[1 / 3]
    eighth = strategy._width_bytes(1 / 8)
    assert strategy.plan_for(DeviceInfo("b", 7, 10, memory_budget_bytes=eighth))[0] == PAPER_STAGES[1 / 8]
    rich = strategy.plan_for(DeviceInfo("c", 0, 10, memory_budget_bytes=10**10))
    assert rich == (PAPER_STAGES[1.0], 2)
    with pytest.raises(ConfigError, match="device d: budget .* holds none"):
        strategy.plan_for(DeviceInfo("d", 0, 10, memory_budget_bytes=1000))


def test_the_paper_plan_exists_only_where_the_paper_has_stages() -> None:
    with pytest.raises(ConfigError, match="×0.3.*use plan = 'memory'"):
        create_strategy("fedepth", cifar_ctx(budgets=[0.3, 1.0], plan="paper"))
    with pytest.raises(ConfigError, match="'resnet20' has none"):
        create_strategy("fedepth", StrategyContext("resnet20", 10, 3, 32, 4, 1, options={"plan": "paper"}))
    with pytest.raises(ConfigError, match="plan must be one of"):
        create_strategy("fedepth", cifar_ctx(plan="measured"))


def test_m_fedepth_tasks_let_the_board_rebuild_the_initial_global_model() -> None:
    """§3.a.7: the auxiliary starts from the initial global model; the board rebuilds it from the task's
    config and seed, bit-for-bit what the server started from."""
    from nestling.edge.procedures.depthwise import initial_global_state
    from nestling.task_params import FedepthParams

    ctx = cifar_ctx()
    ctx.seed = 7
    strategy = create_strategy("m-fedepth", ctx)
    initial = {k: v.clone() for k, v in strategy.global_state.items()}
    tasks = strategy.assign(0, devices())
    assert "initial_model" not in tasks["dev-00000"].hparams  # one model: nothing to rebuild
    rebuilt = initial_global_state(FedepthParams.from_hparams(tasks["dev-00007"].hparams))
    assert rebuilt.keys() == initial.keys()
    assert all(torch.equal(rebuilt[k], initial[k]) for k in initial)


def test_a_registered_budget_overrides_the_tier() -> None:
    strategy = create_strategy("fedepth", cifar_ctx())
    small = strategy.ratio_bytes[BUDGET_PRESETS["fair"][0]]
    rich = DeviceInfo("rich", 0, 10, memory_budget_bytes=10**10)
    profiled = DeviceInfo("board", 7, 10, profile={"budget": {"memory_bytes": small}})
    assert strategy.plan_for(rich)[0].num_stages == 1
    assert strategy.plan_for(profiled) == strategy.plan_for(DeviceInfo("weak", 0, 10))
    with pytest.raises(ConfigError, match="device tiny"):
        strategy.plan_for(DeviceInfo("tiny", 0, 10, memory_budget_bytes=1000))


def test_measured_cost_tables_plan_like_estimated_ones() -> None:
    options = {"budgets": [0.3, 0.6, 1.0]}

    def ctx(**extra: object) -> StrategyContext:
        return StrategyContext(
            arch="preresnet20",
            num_classes=4,
            in_channels=3,
            image_size=16,
            num_clients=3,
            total_rounds=1,
            local={"batch_size": 8, "momentum": 0.9},
            options={**options, **extra},
        )

    estimated, measured = create_strategy("fedepth", ctx()), create_strategy("fedepth", ctx(memory="measure"))
    assert measured.ratio_bytes == estimated.ratio_bytes
    assert [measured.plan_for(d) for d in devices(3)] == [estimated.plan_for(d) for d in devices(3)]


def test_configuration_errors_name_what_is_wrong() -> None:
    with pytest.raises(ConfigError, match="known: fair, lack, surplus"):
        create_strategy("fedepth", cifar_ctx(budgets="plenty"))
    with pytest.raises(ConfigError, match="variant"):
        create_strategy("fedepth", cifar_ctx(variant="mhead"))
    with pytest.raises(ConfigError, match="×0.001"):
        create_strategy("fedepth", cifar_ctx(budgets=[0.001, 1.0]))


def test_aux_variant_carries_the_heads_of_each_clients_stage_ends() -> None:
    strategy = create_strategy("fedepth", cifar_ctx(variant="aux"))
    assert strategy.model.exit_points == tuple(range(8)) and strategy.model.exit_kind == "fedepth"
    tasks = strategy.assign(0, devices())
    for task in tasks.values():
        plan = StagePlan.from_dict(task.hparams["plan"])
        ends = {stage[-1] for stage in plan.stages if stage and stage[-1] < 8}
        assert set(SubmodelSpec.from_dict(task.spec).exits) == ends
        assert all(f"exits.{e}.fc.weight" in task.weights for e in ends)
    (target,) = strategy.eval_targets()
    assert target.spec.exits == () and target.spec.head


def test_aggregation_is_fedavg_over_every_tensor_optionally_tier_weighted(make_ctx, fake_result) -> None:
    for resource_weight in (False, True):
        options = {
            "budgets": [1.0, 1.0],
            "resource_weight": resource_weight,
        }  # tiers 0 and 1, both full width
        strategy = create_strategy("fedepth", make_ctx(options=options))
        tasks = list(strategy.assign(0, [devices()[0], devices()[7]]).values())
        results = [fake_result(t, seed=i, num_samples=n) for i, (t, n) in enumerate(zip(tasks, (10, 30)))]
        weights = [10, 30 * (2 if resource_weight else 1)]  # the reference's p_k × (tier + 1)
        strategy.aggregate(0, list(zip(tasks, results)))
        for key, value in strategy.global_state.items():
            if value.is_floating_point():
                expected = (
                    weights[0] * results[0].weights[key] + weights[1] * results[1].weights[key]
                ) / sum(weights)
                assert torch.allclose(value, expected, atol=1e-6), key


def test_all_clients_at_full_budget_make_fedepth_exactly_fedavg(make_ctx) -> None:
    """Invariant 4 end to end: same tasks, same local updates, same aggregate."""
    ctx = {"local": {"batch_size": 8, "local_steps": 3, "momentum": 0.9, "weight_decay": 5e-4}}
    fedepth = create_strategy("fedepth", make_ctx(options={"budgets": [1.0], "norm_stats": "running"}, **ctx))
    fedavg = create_strategy("fedavg", make_ctx(**ctx))
    generator = torch.Generator().manual_seed(0)
    data = {
        d.device_id: ClientData(torch.randn(16, 3, 8, 8, generator=generator), torch.arange(16) % 4)
        for d in devices(3)
    }
    for strategy in (fedepth, fedavg):
        tasks = strategy.assign(0, devices(3))
        results = [run_task(t, data[t.device_id], DeviceStore()) for t in tasks.values()]
        strategy.aggregate(0, list(zip(tasks.values(), results)))
    for key, value in fedavg.global_state.items():
        assert torch.equal(value, fedepth.global_state[key]), key


def test_bypassed_blocks_can_be_left_out_of_the_mean() -> None:
    ctx = StrategyContext(
        arch="preresnet20",
        num_classes=4,
        in_channels=3,
        image_size=32,
        num_clients=4,
        total_rounds=1,
        local={"batch_size": 16, "local_steps": 1},
        options={"aggregate_bypassed": False},
    )
    strategy = create_strategy("fedepth", ctx)
    costs = strategy.costs
    # Room for every block from B4 on (with the head), not for the 16-channel, full-resolution B1–B3.
    budget = int(max(c + e for c, e in zip(costs.blocks[3:], costs.ends[4:])) / 1.05) + 1
    weak = DeviceInfo("weak", 0, 16, memory_budget_bytes=budget)
    plan, _ = strategy.plan_for(weak)
    assert plan.bypass == (0, 1, 2)
    task = strategy.assign(0, [weak])["weak"]
    result = run_task(task, ClientData(torch.randn(16, 3, 32, 32), torch.arange(16) % 4), DeviceStore())
    assert not any(k.startswith("blocks.0.") for k in result.weights)
    strategy.validate(task, result)
    before = {k: v.clone() for k, v in strategy.global_state.items()}
    strategy.aggregate(0, [(task, result)])
    for key, value in strategy.global_state.items():
        if key.startswith(("blocks.0.", "blocks.1.", "blocks.2.")):
            assert torch.equal(value, before[key])
    assert not torch.equal(strategy.global_state["head.fc.weight"], before["head.fc.weight"])


@pytest.mark.parametrize("method, budgets", [("fedepth", "fair"), ("m-fedepth", "surplus")])
def test_simulate_runs_through_the_coordinator(method: str, budgets: str, tmp_path: Path) -> None:
    cfg = config_from_dict(
        {
            "run": {"rounds": 2, "workers": 1, "eval_every": 1},
            "data": {"dataset": "digits", "clients": 4},
            "model": {"arch": "preresnet20"},
            "method": {"name": method, "budgets": budgets},
            "train": {
                "fraction": 1.0,
                "local_steps": 2,
                "batch_size": 16,
                "lr": 0.05,
                "momentum": 0.9,
                "schedule": "cosine",
            },
        }
    )
    from nestling.simulator.run import run_simulation

    summary = run_simulation(cfg, tmp_path)
    assert [s["name"] for s in summary["submodels"]] == ["full"]
    assert 0.0 <= summary["worst_accuracy"] <= 1.0
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2
