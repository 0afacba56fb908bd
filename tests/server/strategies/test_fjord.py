"""FjORD strategy (METHODS §7.2): tiers p_max, per-width BN statistics averaged over clients with p_max ≥ p,
nested data-weighted aggregation (§1.2 with a_k = n_k)."""

from __future__ import annotations

import pytest
import torch

from nestling.models import kept_channels
from nestling.server.strategies import DeviceInfo, create_strategy
from nestling.server.strategies.fjord import FjORD

LEVELS = (0.2, 0.4, 0.6, 0.8, 1.0)


def fjord(make_ctx, **options) -> FjORD:
    """FjORD with its own paper's width set P (the strategy's default may differ)."""
    options.setdefault("widths", LEVELS)
    strategy = create_strategy("fjord", make_ctx(arch="resnet20", num_clients=10, options=options))
    assert isinstance(strategy, FjORD)
    return strategy


def devices(n: int = 10) -> list[DeviceInfo]:
    return [DeviceInfo(f"dev-{i:05d}", i, 10 * (i + 1)) for i in range(n)]


def test_uniform_tiers_and_the_hparams_each_client_samples_from(make_ctx) -> None:
    strategy = fjord(make_ctx)
    assert [strategy.tier_of(d) for d in devices()] == [0.2, 0.2, 0.4, 0.4, 0.6, 0.6, 0.8, 0.8, 1.0, 1.0]
    tasks = strategy.assign(0, devices())
    for d in devices():
        task = tasks[d.device_id]
        assert task.procedure == "fjord"
        assert task.hparams["p_max"] == strategy.tier_of(d) and task.hparams["widths"] == list(LEVELS)
        assert task.weights["stem.conv.weight"].shape[0] == kept_channels(16, strategy.tier_of(d))


def test_a_client_holds_bn_statistics_only_for_widths_up_to_its_tier(make_ctx) -> None:
    strategy = fjord(make_ctx)
    task = strategy.assign(0, [devices()[4]])["dev-00004"]  # p_max 0.6
    held = {
        k.rsplit("_w", 1)[1] for k in task.weights if "running_mean_w" in k and k.startswith("blocks.0.bn1")
    }
    assert held == {"0", "1", "2"}
    assert task.weights["blocks.0.bn1.running_mean_w2"].shape == (kept_channels(16, 0.6),)
    assert task.weights["blocks.0.bn1.weight"].shape == (kept_channels(16, 0.6),)  # shared affine, sliced


def test_per_width_statistics_average_only_over_clients_with_p_max_at_least_p(make_ctx, fake_result) -> None:
    strategy = fjord(make_ctx)
    chosen = [devices()[1], devices()[5], devices()[9]]  # p_max 0.2, 0.6, 1.0; n = 20, 60, 100
    tasks = list(strategy.assign(0, chosen).values())
    results = [
        fake_result(t, seed=i, num_samples=d.num_samples) for i, (t, d) in enumerate(zip(tasks, chosen))
    ]
    strategy.aggregate(0, list(zip(tasks, results)))
    state = strategy.global_state
    key = "blocks.0.bn1.running_mean_w{}"
    n = [20.0, 60.0, 100.0]
    for level, holders in ((0, [0, 1, 2]), (2, [1, 2]), (4, [2])):
        expected = sum(n[i] * results[i].weights[key.format(level)] for i in holders) / sum(
            n[i] for i in holders
        )
        torch.testing.assert_close(state[key.format(level)], expected)
    # Levels 0.4 and 0.8 were held by the clients above them: 0.4 by p_max 0.6 and 1.0; 0.8 by 1.0 only.
    torch.testing.assert_close(state[key.format(3)], results[2].weights[key.format(3)])


def test_nested_weights_are_data_weighted_region_by_region(make_ctx, fake_result) -> None:
    strategy = fjord(make_ctx)
    chosen = [devices()[1], devices()[9]]
    tasks = list(strategy.assign(0, chosen).values())
    small, large = (
        fake_result(t, seed=i, num_samples=d.num_samples) for i, (t, d) in enumerate(zip(tasks, chosen))
    )
    strategy.aggregate(0, [(tasks[0], small), (tasks[1], large)])
    w = strategy.global_state["blocks.0.conv1.weight"]
    c = kept_channels(16, 0.2)
    inner = (
        20 * small.weights["blocks.0.conv1.weight"] + 100 * large.weights["blocks.0.conv1.weight"][:c, :c]
    ) / 120
    torch.testing.assert_close(w[:c, :c], inner)
    torch.testing.assert_close(w[c:], large.weights["blocks.0.conv1.weight"][c:])


def test_each_width_is_evaluated_with_its_own_statistics(make_ctx) -> None:
    strategy = fjord(make_ctx)
    targets = strategy.eval_targets()
    assert [t.active_width for t in targets] == list(LEVELS)
    assert [t.spec.width for t in targets] == list(LEVELS)


def test_kd_option_reaches_the_clients(make_ctx) -> None:
    strategy = fjord(make_ctx, kd=True)
    assert all(t.hparams["fjord_kd"] for t in strategy.assign(0, devices(2)).values())
    with pytest.raises(Exception, match="no options"):
        fjord(make_ctx, teacher=True)
