"""The registry of strategies by method name: each strategy class registers itself with `@register_strategy`."""

from __future__ import annotations

from typing import TypeVar

from nestling.errors import ConfigError
from nestling.server.strategies.base import Strategy, StrategyContext

S = TypeVar("S", bound=type[Strategy])

STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(cls: S) -> S:
    """Decorator: make `cls` the method named `cls.name` (built-ins in their modules, plugins in theirs). The
    same class again (a re-import) is harmless; another class under a taken name is refused, so a plugin or a
    test cannot silently replace, and later delete, a built-in."""
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ConfigError(f"register_strategy takes a Strategy subclass, got {cls!r}")
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"strategy {cls.__qualname__} must declare its own method name (`name = ...`)")
    registered = STRATEGIES.get(name)
    if registered is not None and registered is not cls:
        raise ConfigError(
            f"[method] method '{name}' is registered twice ({registered.__qualname__} and {cls.__qualname__})"
        )
    STRATEGIES[name] = cls
    return cls


def unregister_strategy(name: str) -> None:
    """Forget method `name` (tests and plugins that define one for a while)."""
    STRATEGIES.pop(name, None)


def snapshot_strategies() -> dict[str, type[Strategy]]:
    """The registry as it is now, for `restore_strategies`."""
    return dict(STRATEGIES)


def restore_strategies(snapshot: dict[str, type[Strategy]]) -> None:
    """Put the registry back exactly as `snapshot_strategies` saw it (added names gone, replaced ones back)."""
    STRATEGIES.clear()
    STRATEGIES.update(snapshot)


def create_strategy(method: str, ctx: StrategyContext) -> Strategy:
    """A fresh strategy of `method` for the run `ctx` describes; ConfigError listing the known methods."""
    try:
        cls = STRATEGIES[method]
    except KeyError:
        raise ConfigError(
            f"[method] unknown method '{method}' (known: {', '.join(sorted(STRATEGIES))})"
        ) from None
    return cls(ctx)
