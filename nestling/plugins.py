"""Plugins: modules that register model families, methods, procedures or board classes before a command runs.

`NESTLING_PLUGINS=pkg.mod1,pkg.mod2 nestling simulate ...` imports those modules first. The variable is inherited
by the simulator's worker processes and by agents started from a shell, so a procedure a plugin registers is
known wherever a task may run.
"""

from __future__ import annotations

import importlib
import os

from nestling.errors import ConfigError

ENV = "NESTLING_PLUGINS"
_loaded: set[str] = set()


def load_plugins(spec: str | None = None) -> list[str]:
    """Import every module named in `spec` (default: $NESTLING_PLUGINS), once each; the names imported."""
    text = os.environ.get(ENV, "") if spec is None else spec
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name in _loaded:
            continue
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"{ENV}: cannot import plugin module '{name}': {exc}") from exc
        _loaded.add(name)
    return names
