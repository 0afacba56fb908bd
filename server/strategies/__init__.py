"""Strategies by name: assignment + aggregation + the local procedure each device runs."""

from __future__ import annotations

from nestling.errors import ConfigError
from nestling.server.strategies.base import DeviceInfo, EvalTarget, Strategy, StrategyContext
from nestling.server.strategies.depthfl import DepthFL
from nestling.server.strategies.dynamicfl import DynamicFL
from nestling.server.strategies.fedavg import FedAvg
from nestling.server.strategies.fedepth import FeDepth, MFeDepth
from nestling.server.strategies.fedtrans import FedTrans
from nestling.server.strategies.fjord import FjORD
from nestling.server.strategies.heterofl import HeteroFL
from nestling.server.strategies.nefl import NeFLD, NeFLW, NeFLWD
from nestling.server.strategies.scalefl import ScaleFL

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (FedAvg, HeteroFL, FjORD, DepthFL, ScaleFL, NeFLW, NeFLD, NeFLWD)
}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Add a strategy class (FeDepth, FedTrans, ... register themselves here)."""
    STRATEGIES[cls.name] = cls
    return cls


for _registered in (FeDepth, MFeDepth, DynamicFL, FedTrans):
    register_strategy(_registered)


def create_strategy(method: str, ctx: StrategyContext) -> Strategy:
    try:
        cls = STRATEGIES[method]
    except KeyError:
        raise ConfigError(
            f"[method] unknown method '{method}' (known: {', '.join(sorted(STRATEGIES))})"
        ) from None
    return cls(ctx)


__all__ = [
    "STRATEGIES",
    "DeviceInfo",
    "EvalTarget",
    "Strategy",
    "StrategyContext",
    "create_strategy",
    "register_strategy",
]
