"""The strategy a reproduction preset's entry builds, as `nestling reproduce` would (CIFAR-10 shapes)."""

from __future__ import annotations

from typing import Any

from nestling.server.strategies import StrategyContext, create_strategy
from nestling.server.strategies.base import Strategy
from nestling.simulator.reproduce import Comparison, Entry


def preset_strategy(comparison: Comparison, entry: Entry, seed: int = 0, **option_changes: Any) -> Strategy:
    """`entry`'s method with its preset options (and `option_changes`) at the comparison's scale."""
    cfg = comparison.config(entry, seed=seed)
    ctx = StrategyContext(
        arch=cfg.model.arch,
        num_classes=10,
        in_channels=3,
        image_size=32,
        num_clients=cfg.data.clients,
        total_rounds=cfg.run.rounds,
        options={**dict(cfg.method.options), **option_changes},
    )
    return create_strategy(cfg.method.name, ctx)
