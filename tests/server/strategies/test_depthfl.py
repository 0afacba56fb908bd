"""DepthFL (METHODS §7.3): depth prefixes with a classifier per stage, count-averaged, ensemble evaluation."""

from __future__ import annotations

import torch

from nestling.models import build
from nestling.server.strategies import DeviceInfo, create_strategy
from nestling.server.strategies.depthfl import DepthFL, stage_ends


def depthfl(make_ctx, arch: str = "resnet20", **options) -> DepthFL:
    strategy = create_strategy("depthfl", make_ctx(arch=arch, image_size=16, num_clients=8, options=options))
    assert isinstance(strategy, DepthFL)
    return strategy


def devices(n: int = 8) -> list[DeviceInfo]:
    return [DeviceInfo(f"dev-{i:05d}", i, 10 + i) for i in range(n)]


def test_resnet18_has_four_depth_groups_with_one_classifier_per_stage(make_ctx) -> None:
    strategy = depthfl(make_ctx, arch="resnet18")
    assert stage_ends("resnet18", 16) == [2, 4, 6, 8]
    assert strategy.model.exit_points == (1, 3, 5)
    shapes = [(s.depth, s.exits, s.head) for s in strategy.specs]
    assert shapes == [(2, (1,), False), (4, (1, 3), False), (6, (1, 3, 5), False), (None, (1, 3, 5), True)]
    assert [strategy.spec_for(0, d).exits for d in devices()] == [
        (1,),
        (1,),
        (1, 3),
        (1, 3),
        (1, 3, 5),
        (1, 3, 5),
        (1, 3, 5),
        (1, 3, 5),
    ]
    for d, spec in enumerate(strategy.specs, start=1):  # a depth-d model has exactly d classifiers
        assert build(spec, device="meta").num_outputs == d


def test_depth_one_clients_never_touch_deeper_layers_or_classifiers(make_ctx, fake_result) -> None:
    strategy = depthfl(make_ctx)
    before = {k: v.clone() for k, v in strategy.global_state.items()}
    tasks = strategy.assign(0, devices(2))  # both in group 1
    assert all(
        not any(k.startswith(("blocks.3.", "exits.5.", "head.")) for k in t.weights) for t in tasks.values()
    )
    strategy.aggregate(0, [(t, fake_result(t, seed=i)) for i, t in enumerate(tasks.values())])
    for key, value in strategy.global_state.items():
        deep = key.startswith((*(f"blocks.{b}." for b in range(3, 9)), "exits.5.", "head."))
        if deep:
            assert torch.equal(value, before[key]), key
        elif value.is_floating_point():
            assert not torch.equal(value, before[key]), key


def test_all_full_depth_clients_without_kd_aggregate_to_uniform_fedavg(make_ctx, fake_result) -> None:
    """METHODS §7.3 invariant: kd off, FedDyn off, every client at full depth ⇒ uniform FedAvg."""
    strategy = depthfl(make_ctx, kd=False, feddyn_alpha=0.0)
    deepest = devices()[6:]
    tasks = list(strategy.assign(0, deepest).values())
    assert all(t.hparams["kd"] is False for t in tasks)
    results = [fake_result(t, seed=i, num_samples=5 + 50 * i) for i, t in enumerate(tasks)]
    strategy.aggregate(0, list(zip(tasks, results)))
    for key, value in strategy.global_state.items():
        if value.is_floating_point():
            torch.testing.assert_close(
                value, (results[0].weights[key] + results[1].weights[key]) / 2, msg=key
            )


def test_shallow_and_deep_clients_share_the_layers_they_both_hold(make_ctx, fake_result) -> None:
    strategy = depthfl(make_ctx, feddyn_alpha=0.0)  # the count-based mean alone
    shallow, deep = strategy.assign(0, [devices()[0], devices()[7]]).values()
    a, b = fake_result(shallow, seed=1), fake_result(deep, seed=2)
    strategy.aggregate(0, [(shallow, a), (deep, b)])
    torch.testing.assert_close(
        strategy.global_state["blocks.0.conv1.weight"],
        (a.weights["blocks.0.conv1.weight"] + b.weights["blocks.0.conv1.weight"]) / 2,
    )
    torch.testing.assert_close(
        strategy.global_state["blocks.4.conv1.weight"], b.weights["blocks.4.conv1.weight"]
    )


def test_feddyn_is_on_by_default_with_the_references_alpha(make_ctx) -> None:
    """METHODS §7.3: DepthFL's published numbers include FedDyn with α = 0.1."""
    task = depthfl(make_ctx).assign(0, devices(1))["dev-00000"]
    assert task.hparams["feddyn_alpha"] == 0.1
    assert depthfl(make_ctx, feddyn_alpha=0.0).assign(0, devices(1))["dev-00000"].hparams["feddyn_alpha"] == 0


def test_clients_get_the_kd_ramp_and_evaluation_ensembles_every_classifier(make_ctx) -> None:
    strategy = depthfl(make_ctx, kd_ramp_rounds=50)
    task = strategy.assign(0, devices(1))["dev-00000"]
    assert (
        task.procedure == "depthfl-kd" and task.hparams["kd"] is True and task.hparams["kd_ramp_rounds"] == 50
    )
    targets = strategy.eval_targets()
    assert [t.name for t in targets] == ["d1", "d2", "d3"] and all(t.ensemble for t in targets)
