"""One code path from a run's config to its strategy and round policy, for `nestling server` and `simulate`."""

from __future__ import annotations

from nestling.config import config_from_dict
from nestling.server.run_setup import round_policy, strategy_context, strategy_for_run

CONFIG = {
    "run": {
        "rounds": 7,
        "seed": 3,
        "deadline_s": 40.0,
        "train_share": 0.5,
        "quorum": 0.8,
        "max_update_norm": 9.0,
    },
    "data": {"dataset": "digits", "clients": 6},
    "model": {"arch": "tinycnn"},
    "method": {"name": "heterofl", "options": {"rates": [1.0, 0.5]}},
    "train": {"fraction": 0.5, "local_steps": 2, "batch_size": 16, "lr": 0.03},
}


def test_the_context_carries_the_deadline_and_training_share_strategies_plan_with() -> None:
    cfg = config_from_dict(CONFIG)
    ctx = strategy_context(cfg, num_classes=10, input_shape=(1, 16, 16), num_clients=6, dataset="digits")
    assert (ctx.deadline_s, ctx.train_share, ctx.dataset) == (40.0, 0.5, "digits")
    assert (ctx.in_channels, ctx.image_size, ctx.total_rounds, ctx.seed) == (1, 16, 7, 3)
    assert ctx.local["batch_size"] == 16 and ctx.options == {"rates": [1.0, 0.5]}
    strategy = strategy_for_run(cfg, num_classes=10, input_shape=(1, 16, 16), num_clients=6, dataset="digits")
    assert strategy.name == "heterofl" and strategy.time_budget_s == 20.0


def test_the_round_policy_is_the_runs() -> None:
    policy = round_policy(config_from_dict(CONFIG))
    assert (policy.rounds, policy.fraction, policy.quorum, policy.deadline_s, policy.seed) == (
        7,
        0.5,
        0.8,
        40.0,
        3,
    )
    assert policy.robust.max_update_norm == 9.0
