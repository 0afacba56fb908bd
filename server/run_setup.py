"""The one way a run's config becomes its strategy and round policy: `nestling server` and `nestling simulate`
both build them here, so a simulated or replayed fleet is planned with the same deadline, training share and
options, and its rounds run under the same rules, as a real one."""

from __future__ import annotations

from nestling.config import SimConfig
from nestling.schedule import LrSchedule
from nestling.server.coordinator import RoundPolicy
from nestling.server.screening import robust_policy
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.server.strategies.base import Strategy


def strategy_context(
    cfg: SimConfig, *, num_classes: int, input_shape: tuple[int, ...], num_clients: int, dataset: str | None
) -> StrategyContext:
    """The strategy's context from a run's config ([run], [train], [model], [method]) and its data."""
    channels, size = int(input_shape[0]), int(input_shape[1])
    run, train = cfg.run, cfg.train
    return StrategyContext(
        arch=cfg.model.arch,
        num_classes=num_classes,
        in_channels=channels,
        image_size=size,
        num_clients=num_clients,
        total_rounds=run.rounds,
        seed=run.seed,
        schedule=LrSchedule(train.schedule, train.lr, train.gamma, tuple(train.milestones)),
        local=train.local_hparams(),
        options=dict(cfg.method.options),
        model_extra=dict(cfg.model.extra),
        dataset=dataset,
        # Boards that sent a profile (a fleet's hello, a replayed trace's figures) are sized to fit the
        # deadline's training share (profiler/fit.py); without a deadline only memory counts.
        deadline_s=run.deadline_s,
        train_share=run.train_share,
    )


def strategy_for_run(
    cfg: SimConfig, *, num_classes: int, input_shape: tuple[int, ...], num_clients: int, dataset: str | None
) -> Strategy:
    """The run's strategy ([method] name) built from `strategy_context`."""
    ctx = strategy_context(
        cfg, num_classes=num_classes, input_shape=input_shape, num_clients=num_clients, dataset=dataset
    )
    return create_strategy(cfg.method.name, ctx)


def round_policy(cfg: SimConfig) -> RoundPolicy:
    """How the run's rounds go: participation, over-selection, quorum, deadline, evaluation, checkpoints,
    screening."""
    run = cfg.run
    return RoundPolicy(
        rounds=run.rounds,
        fraction=cfg.train.fraction,
        over_selection=run.over_selection,
        quorum=run.quorum,
        deadline_s=run.deadline_s,
        eval_every=run.eval_every,
        checkpoint_every=run.checkpoint_every,
        seed=run.seed,
        robust=robust_policy(run),
    )


__all__ = ["round_policy", "strategy_context", "strategy_for_run"]
