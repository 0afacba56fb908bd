"""Strategies by name: assignment + aggregation + the local procedure each device runs.

Every module of this package is imported here and each strategy class registers itself with
`@register_strategy` (nestling.discovery): a new method is one module, and a plugin's strategy registers the
same way from its own module.
"""

from __future__ import annotations

from nestling.discovery import import_modules
from nestling.server.strategies.base import DeviceInfo, EvalTarget, Strategy, StrategyContext
from nestling.server.strategies.registry import (
    STRATEGIES,
    create_strategy,
    register_strategy,
    restore_strategies,
    snapshot_strategies,
    unregister_strategy,
)

import_modules(__name__, __path__)

__all__ = [
    "STRATEGIES",
    "DeviceInfo",
    "EvalTarget",
    "Strategy",
    "StrategyContext",
    "create_strategy",
    "register_strategy",
    "restore_strategies",
    "snapshot_strategies",
    "unregister_strategy",
]
