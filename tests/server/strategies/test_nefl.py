"""NeFL (METHODS §2): NeFedAvg on consistent tensors, per-submodel BN/step stores, presets — invariants §2.b."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nestling.edge.procedures import ClientData
from nestling.edge.trainer import run_task
from nestling.messages import Result, Task
from nestling.models import ModelConfig, build
from nestling.models.cost import count_parameters
from nestling.server.strategies import DeviceInfo, create_strategy
from nestling.server.strategies import nefl as nefl_module
from nestling.server.strategies.nefl import NeFL
from nestling.server.strategies.nefl_presets import nefl_family
from nestling.slicing import scatter
from nestling.spec import SubmodelSpec

NUM_BLOCKS = 9  # resnet20


def make_nefl(make_ctx, mode: str = "wd", family=None, monkeypatch=None, **options) -> NeFL:
    if family is not None:
        monkeypatch.setattr(nefl_module, "nefl_family", lambda arch, mode, extra=None: family)
    ctx = make_ctx(arch="resnet20", num_classes=5, num_clients=10, options=options)
    strategy = create_strategy(f"nefl-{mode}", ctx)
    assert isinstance(strategy, NeFL)
    return strategy


def task(strategy: NeFL, k: int, client: int, round_index: int = 0) -> Task:
    spec = strategy.specs[k]
    return Task(
        round=round_index,
        device_id=f"dev-{client:05d}",
        spec=spec.to_dict(),
        weights=strategy.task_weights(spec),
        procedure=strategy.procedure,
        task_id=f"r{round_index}-c{client}",
    )


def constant_result(t: Task, value: float) -> Result:
    weights = {
        k: torch.full_like(v, value) if v.is_floating_point() else v.clone() for k, v in t.weights.items()
    }
    return Result(
        round=t.round,
        device_id=t.device_id,
        task_id=t.task_id,
        spec_id=t.spec_id,
        weights=weights,
        num_samples=1,
    )


def snapshot(strategy: NeFL) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    return (
        {k: v.clone() for k, v in strategy.global_state.items()},
        [{k: v.clone() for k, v in store.items()} for store in strategy.stores],
    )


def block_of(key: str) -> int | None:
    return int(key.split(".")[1]) if key.startswith("blocks.") else None


# -- §2.b.1 ------------------------------------------------------------------------------------------
def test_all_clients_on_the_full_model_is_uniform_fedavg_of_everything(make_ctx, fake_result) -> None:
    strategy = make_nefl(make_ctx)
    full = len(strategy.specs) - 1
    tasks = [task(strategy, full, c) for c in range(3)]
    results = [fake_result(t, seed=c, num_samples=10 * (c + 1)) for c, t in enumerate(tasks)]
    strategy.aggregate(0, list(zip(tasks, results)))
    for key in strategy.consistent:
        mean = torch.stack([r.weights[key] for r in results]).mean(0)  # uniform: sample counts are ignored
        torch.testing.assert_close(strategy.global_state[key], mean, rtol=1e-6, atol=1e-6, msg=key)
    for key, value in strategy.stores[full].items():
        if value.is_floating_point():
            torch.testing.assert_close(value, torch.stack([r.weights[key] for r in results]).mean(0), msg=key)


# -- §2.b.2 ------------------------------------------------------------------------------------------
def test_the_paper_example_gives_denominators_7_5_2(make_ctx, monkeypatch) -> None:
    # Block 4 belongs to submodels 1, 3 and 5 only; 2, 3 and 2 clients trained them.
    rho = [0.3, 0.45, 0.6, 0.8, 1.0]
    without_4 = tuple(b for b in range(NUM_BLOCKS) if b != 4)
    family = [
        (rho[0], tuple(range(NUM_BLOCKS))),
        (rho[1], without_4),
        (rho[2], tuple(range(NUM_BLOCKS))),
        (rho[3], without_4),
        (1.0, None),
    ]
    strategy = make_nefl(make_ctx, family=family, monkeypatch=monkeypatch)
    clients = [0, 0, 2, 2, 2, 4, 4]  # submodel index (0-based) of clients 1..7
    accepted = []
    for c, k in enumerate(clients, start=1):
        t = task(strategy, k, c)
        accepted.append((t, constant_result(t, float(c))))
    strategy.aggregate(0, accepted)
    w = strategy.global_state["blocks.4.conv1.weight"]  # stage 2: 32 × 32 global channels
    n1, n3 = math.ceil(32 * rho[0]), math.ceil(32 * rho[2])
    assert float(w[0, 0, 0, 0]) == pytest.approx(28 / 7)  # inside ρ1: clients 1..7
    assert float(w[n1, 0, 0, 0]) == pytest.approx((3 + 4 + 5 + 6 + 7) / 5)  # ρ1..ρ3: clients 3..7
    assert float(w[0, n3, 0, 0]) == pytest.approx((6 + 7) / 2)  # ρ3..1: the two full-model clients
    assert float(w[31, 31, 0, 0]) == pytest.approx(6.5)


@st.composite
def nefl_rounds(draw):
    ratios = sorted(draw(st.lists(st.sampled_from([0.2, 0.35, 0.5, 0.71, 0.9]), min_size=1, max_size=3)))
    family = []
    for rho in ratios:
        kept = draw(st.sets(st.integers(0, NUM_BLOCKS - 1), min_size=1))
        family.append((rho, tuple(sorted(kept))))
    family.append((1.0, None))
    clients = draw(st.lists(st.integers(0, len(family) - 1), min_size=1, max_size=6))
    return family, clients, draw(st.integers(0, 1000))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nefl_rounds())
def test_nefedavg_equals_the_elementwise_masked_mean_with_depth_aware_membership(make_ctx, draw) -> None:
    """A client counts for element e iff e is inside its width prefix and e's block is one it executes
    (stem and classifier belong to every submodel) — METHODS §2.a.6.6, brute force over masks."""
    family, clients, seed = draw
    with pytest.MonkeyPatch.context() as monkeypatch:
        strategy = make_nefl(make_ctx, family=family, monkeypatch=monkeypatch)
    before = {k: v.clone() for k, v in strategy.global_state.items()}
    accepted = []
    generator = torch.Generator().manual_seed(seed)
    for c, k in enumerate(clients):
        t = task(strategy, k, c)
        weights = {
            key: torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
            for key, v in t.weights.items()
        }
        accepted.append((t, Result(0, t.device_id, t.task_id, t.spec_id, weights, 1)))
    strategy.aggregate(0, accepted)
    for key in strategy.consistent:
        total = torch.zeros_like(before[key])
        count = torch.zeros_like(before[key])
        for t, r in accepted:
            spec = SubmodelSpec.from_dict(t.spec)
            b = block_of(key)
            if key not in r.weights or (b is not None and spec.blocks is not None and b not in spec.blocks):
                continue
            region = tuple(slice(0, n) for n in r.weights[key].shape)
            total[region] += r.weights[key]
            count[region] += 1
        expected = torch.where(count > 0, total / count.clamp_min(1), before[key])
        torch.testing.assert_close(strategy.global_state[key], expected, rtol=1e-5, atol=1e-6, msg=key)


def test_a_skipped_stage_entry_block_uses_its_projection_but_is_not_aggregated_from_it(
    make_ctx, monkeypatch
) -> None:
    """AMBIG-2 default (the reference): only clients that execute block 3 count for its projection conv."""
    family = [(1.0, tuple(b for b in range(NUM_BLOCKS) if b != 3)), (1.0, None)]
    strategy = make_nefl(make_ctx, family=family, monkeypatch=monkeypatch)
    skipping, full = task(strategy, 0, 1), task(strategy, 1, 2)
    assert "blocks.3.shortcut.0.weight" in skipping.weights  # the skipping submodel runs the projection
    strategy.aggregate(0, [(skipping, constant_result(skipping, 1.0)), (full, constant_result(full, 3.0))])
    assert (strategy.global_state["blocks.3.shortcut.0.weight"] == 3.0).all()
    assert (strategy.global_state["blocks.2.conv1.weight"] == 2.0).all()
    # The flag of AMBIG-2: aggregate the projection from every client that used it.
    every = make_nefl(make_ctx, family=family, monkeypatch=monkeypatch, shortcut_from_skipping=True)
    skipping, full = task(every, 0, 1), task(every, 1, 2)
    every.aggregate(0, [(skipping, constant_result(skipping, 1.0)), (full, constant_result(full, 3.0))])
    assert (every.global_state["blocks.3.shortcut.0.weight"] == 2.0).all()


# -- §2.b.3 ------------------------------------------------------------------------------------------
def test_elements_no_sampled_submodel_covers_keep_their_values(make_ctx, monkeypatch) -> None:
    family = [(0.5, (0, 1, 2, 3)), (1.0, None)]
    strategy = make_nefl(make_ctx, family=family, monkeypatch=monkeypatch)
    before, _ = snapshot(strategy)
    t = task(strategy, 0, 1)
    strategy.aggregate(0, [(t, constant_result(t, 5.0))])
    state = strategy.global_state
    for b in range(4, NUM_BLOCKS):  # blocks no sampled submodel contains: not zeroed (the reference's bug)
        for key in (f"blocks.{b}.conv1.weight", f"blocks.{b}.conv2.weight"):
            assert torch.equal(state[key], before[key]), key
    assert (state["blocks.0.conv1.weight"][:8, :8] == 5).all()
    assert torch.equal(state["blocks.0.conv1.weight"][8:], before["blocks.0.conv1.weight"][8:])
    assert (state["head.fc.weight"][:, :32] == 5).all()
    assert torch.equal(state["head.fc.weight"][:, 32:], before["head.fc.weight"][:, 32:])


# -- §2.b.4 / §2.b.5 ---------------------------------------------------------------------------------
def test_submodel_weights_are_nested_slices_that_scatter_back_unchanged(make_ctx) -> None:
    strategy = make_nefl(make_ctx, mode="w")
    specs = strategy.specs
    for small, large in itertools.pairwise(specs):
        a, b = strategy.task_weights(small), strategy.task_weights(large)
        for key in strategy.consistent & set(a):
            region = tuple(slice(0, n) for n in a[key].shape)
            assert torch.equal(b[key][region], a[key]), key
    before = {k: v.clone() for k, v in strategy.global_state.items()}
    for spec in specs:
        consistent = {k: v for k, v in strategy.task_weights(spec).items() if k in strategy.consistent}
        scatter(strategy.global_state, consistent, spec)
    assert all(torch.equal(strategy.global_state[k], before[k]) for k in before)


@pytest.mark.parametrize("mode", ["w", "d", "wd"])
def test_every_submodel_keeps_rgb_inputs_all_class_rows_and_the_shared_classifier_bias(
    make_ctx, mode: str
) -> None:
    strategy = make_nefl(make_ctx, mode=mode)
    biases = []
    for spec in strategy.specs:
        weights = strategy.task_weights(spec)
        assert weights["stem.conv.weight"].shape[1] == 3
        assert weights["head.fc.weight"].shape[0] == 5
        biases.append(weights["head.fc.bias"])
    assert all(torch.equal(b, biases[0]) for b in biases)
    assert "head.fc.bias" in strategy.consistent
    assert not any("head.fc.bias" in store for store in strategy.stores)


def test_vit_layer_norms_are_consistent_and_step_sizes_per_submodel(make_ctx) -> None:
    """AMBIG-3 default: LayerNorm consistent (the paper's better variant); two step sizes per block owned by k."""
    ctx = make_ctx(arch="vit", model_extra={"dim": 16, "depth": 2, "heads": 2, "mlp_dim": 32})
    strategy = create_strategy("nefl-w", ctx)
    assert {"blocks.0.ln1.weight", "head.norm.weight", "blocks.1.q.weight"} <= strategy.consistent
    for store in strategy.stores:
        assert set(store) == {
            "blocks.0.step_sa",
            "blocks.0.step_ffn",
            "blocks.1.step_sa",
            "blocks.1.step_ffn",
        }


# -- §2.b.8 ------------------------------------------------------------------------------------------
def test_bn_store_k_is_the_mean_of_submodel_k_uploads_and_unsampled_stores_are_untouched(make_ctx) -> None:
    strategy = make_nefl(make_ctx, mode="w")
    _, stores_before = snapshot(strategy)
    accepted = []
    for c, (k, value) in enumerate([(1, 1.0), (1, 4.0), (3, 7.0)]):
        t = task(strategy, k, c)
        accepted.append((t, constant_result(t, value)))
    strategy.aggregate(0, accepted)
    for key, value in strategy.stores[1].items():
        if value.is_floating_point():
            assert (value == 2.5).all(), key  # mean of the two submodel-2 uploads only
    assert all((v == 7.0).all() for v in strategy.stores[3].values() if v.is_floating_point())
    for k in (0, 2, 4):
        assert all(torch.equal(strategy.stores[k][key], stores_before[k][key]) for key in stores_before[k])
    assert set(strategy.stores[1]) == {
        k for k, v in accepted[0][0].weights.items() if k not in strategy.consistent
    }


def test_bn_batch_counters_of_a_store_are_summed_over_its_uploads(make_ctx) -> None:
    """§1.3 / §2.a.6 step 5: num_batches_tracked is summed, not averaged (nor the largest taken): the store
    counts the batches every upload of submodel k trained on top of what it had; other stores keep theirs."""
    strategy = make_nefl(make_ctx, mode="w")
    counters = [key for key, v in strategy.stores[1].items() if not v.is_floating_point()]
    assert counters and all(key.endswith("num_batches_tracked") for key in counters)
    for key in counters:  # a store that has already counted some batches
        strategy.stores[1][key] = torch.tensor(40)
    accepted = []
    for c, (k, trained) in enumerate([(1, 3), (1, 5), (3, 2)]):
        t = task(strategy, k, c)
        result = constant_result(t, 1.0)
        for key in counters:
            result.weights[key] = t.weights[key] + trained
        accepted.append((t, result))
    strategy.aggregate(0, accepted)
    for key in counters:
        assert strategy.stores[1][key].item() == 40 + 3 + 5, key
        assert strategy.stores[1][key].dtype == torch.int64
        assert strategy.stores[3][key].item() == 0 + 2, key
        assert strategy.stores[0][key].item() == 0, key


# -- §2.b.9 ------------------------------------------------------------------------------------------
def test_resnet18_nefl_d_submodels_hold_the_published_parameter_fractions() -> None:
    model = ModelConfig("resnet18")
    full = count_parameters(build(SubmodelSpec.full(model), device="meta"))
    fractions = [
        count_parameters(build(SubmodelSpec(model, width=rho, blocks=kept), device="meta")) / full
        for rho, kept in nefl_family("resnet18", "d")
    ]
    assert fractions == pytest.approx([0.20, 0.39, 0.57, 0.81, 1.0], abs=0.02)


def test_resnet18_nefl_wd_widths_are_sqrt_of_the_parameter_fractions() -> None:
    family = nefl_family("resnet18", "wd")
    assert [rho for rho, _ in family] == pytest.approx([math.sqrt(g) for g in (0.34, 0.4, 0.6, 0.8, 1.0)])
    assert family[0][1] == (0, 1, 2, 3, 4, 5, 6) and all(kept is None for _, kept in family[1:])
    model = ModelConfig("resnet18")
    full = count_parameters(build(SubmodelSpec.full(model), device="meta"))
    fractions = [
        count_parameters(build(SubmodelSpec(model, width=rho, blocks=kept), device="meta")) / full
        for rho, kept in family
    ]
    assert fractions == pytest.approx([0.20, 0.40, 0.60, 0.80, 1.0], abs=0.02)


# -- §2.b.10 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("learnable", [True, False])
def test_step_sizes_start_at_one_and_train_only_when_learnable(make_ctx, learnable: bool) -> None:
    strategy = make_nefl(make_ctx, mode="w", learnable_step=learnable)
    assert all(float(v) == 1.0 for store in strategy.stores for k, v in store.items() if k.endswith(".step"))
    t = task(strategy, 2, 1)
    t.hparams = {"lr": 0.1, "batch_size": 4, "local_steps": 3, "seed": 1}
    generator = torch.Generator().manual_seed(0)
    data = ClientData(torch.randn(8, 3, 8, 8, generator=generator), torch.arange(8) % 5)
    result = run_task(t, data)
    steps = [float(v) for k, v in result.weights.items() if k.endswith(".step")]
    assert len(steps) == NUM_BLOCKS
    assert all(s == 1.0 for s in steps) != learnable


# -- assignment, export, checkpoints ---------------------------------------------------------------------
def test_tiers_are_contiguous_and_flex_draws_within_two_tiers_reproducibly(make_ctx) -> None:
    strategy = make_nefl(make_ctx)  # 10 clients, 5 submodels: tiers of 2 clients
    devices = [DeviceInfo(f"dev-{i:05d}", i, 10) for i in range(10)]
    assert [strategy.tier_of(d) for d in devices] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    for d in devices:
        drawn = {strategy.index_of[strategy.spec_for(r, d).id] for r in range(40)}
        tier = strategy.tier_of(d)
        assert drawn <= set(range(max(0, tier - 2), min(4, tier + 2) + 1)) and len(drawn) > 1
        assert strategy.spec_for(7, d) == strategy.spec_for(7, d)
    fixed = make_nefl(make_ctx, flex=0)
    assert all(fixed.index_of[fixed.spec_for(r, d).id] == fixed.tier_of(d) for d in devices for r in range(5))


def test_the_exported_global_model_uses_the_largest_submodels_bn(make_ctx) -> None:
    strategy = make_nefl(make_ctx)
    t = task(strategy, 4, 0)
    strategy.aggregate(0, [(t, constant_result(t, 3.0))])
    exported = strategy.global_export_state()
    assert (exported["blocks.0.bn1.weight"] == 3.0).all() and (exported["blocks.0.step"] == 3.0).all()
    build(SubmodelSpec.full(strategy.model)).load_state_dict(exported)


def test_checkpoint_state_round_trips_consistent_weights_and_every_store(make_ctx) -> None:
    strategy = make_nefl(make_ctx)
    t = task(strategy, 1, 0)
    strategy.aggregate(0, [(t, constant_result(t, 2.0))])
    tensors = strategy.state_tensors()
    fresh = make_nefl(make_ctx, flex=2)
    fresh.load_state(tensors, {})
    assert all(torch.equal(fresh.global_state[k], strategy.global_state[k]) for k in strategy.global_state)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(fresh.stores, strategy.stores) for k in a)


def test_nefl_do_initial_steps_count_the_skipped_blocks_after_each_kept_block() -> None:
    """§2.a.1: stage mask 1,8,0,0,0,0,0,0,0 style — a kept block followed by m skipped blocks starts at 1 + m."""
    from nestling.models.config import ModelConfig
    from nestling.server.strategies.nefl import do_initial_steps
    from nestling.spec import SubmodelSpec

    # resnet56: three stages of nine blocks; keep blocks 0 and 1 of stage 1 only, the first of stages 2 and 3.
    spec = SubmodelSpec(ModelConfig("resnet56"), blocks=(0, 1, 9, 18))
    assert do_initial_steps(spec) == {0: 1.0, 1: 8.0, 9: 9.0, 18: 9.0}
    assert do_initial_steps(SubmodelSpec(ModelConfig("resnet56"))) == {}


def test_step_init_do_seeds_each_submodel_store() -> None:
    from nestling.server.strategies import StrategyContext, create_strategy
    from nestling.server.strategies.nefl import do_initial_steps

    ctx = StrategyContext(
        arch="resnet56",
        num_classes=10,
        in_channels=3,
        image_size=32,
        num_clients=5,
        total_rounds=2,
        options={"step_init": "do"},
    )
    strategy = create_strategy("nefl-d", ctx)
    for spec, store in zip(strategy.specs, strategy.stores):
        for block, value in do_initial_steps(spec).items():
            assert float(store[f"blocks.{block}.step"]) == value
    assert any(v > 1 for spec in strategy.specs for v in do_initial_steps(spec).values())
