"""Strategies register themselves by decorator in their own modules; the package discovers the modules."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nestling.server.strategies as package
from nestling.errors import ConfigError
from nestling.server.strategies import (
    STRATEGIES,
    create_strategy,
    register_strategy,
    restore_strategies,
    snapshot_strategies,
    unregister_strategy,
)
from nestling.server.strategies.fedavg import FedAvg
from nestling.server.strategies.nefl import NeFL, NeFLWD


@pytest.fixture
def registry() -> Iterator[None]:
    saved = snapshot_strategies()
    yield
    restore_strategies(saved)
    assert snapshot_strategies() == saved


def test_every_module_is_discovered_and_every_method_registered_by_its_own_class() -> None:
    modules = sorted(p.stem for p in Path(package.__file__).parent.glob("*.py") if p.stem != "__init__")
    assert all(f"nestling.server.strategies.{name}" in sys.modules for name in modules)
    assert {
        "fedavg", "heterofl", "fjord", "depthfl", "scalefl", "nefl-w", "nefl-d", "nefl-wd",
        "fedepth", "m-fedepth", "dynamicfl", "fedtrans",
    } <= set(STRATEGIES)  # fmt: skip
    assert all(cls.__dict__["name"] == name for name, cls in STRATEGIES.items())
    assert STRATEGIES["nefl-wd"] is NeFLWD and NeFL not in STRATEGIES.values()  # the base is not a method


def test_another_class_under_a_taken_name_is_refused_and_the_built_in_stays(registry: None) -> None:
    class Impostor(FedAvg):
        name = "fedavg"

    with pytest.raises(ConfigError, match="method 'fedavg' is registered twice"):
        register_strategy(Impostor)
    assert STRATEGIES["fedavg"] is FedAvg
    assert register_strategy(FedAvg) is FedAvg  # the same class again (a re-import) is harmless


def test_a_class_must_declare_its_own_name(registry: None) -> None:
    class Unnamed(FedAvg):
        """Inherits FedAvg's name: registering it would take over 'fedavg'."""

    with pytest.raises(ConfigError, match="must declare its own method name"):
        register_strategy(Unnamed)
    with pytest.raises(ConfigError, match="takes a Strategy subclass"):
        register_strategy(dict)  # type: ignore[type-var]


def test_a_plugin_strategy_registers_by_decorator_and_a_restore_forgets_it() -> None:
    saved = snapshot_strategies()

    @register_strategy
    class Plugin(FedAvg):
        name = "test-plugin-method"

    assert STRATEGIES["test-plugin-method"] is Plugin
    unregister_strategy("fedavg")
    restore_strategies(saved)
    assert "test-plugin-method" not in STRATEGIES and STRATEGIES["fedavg"] is FedAvg


def test_an_unknown_method_names_the_known_ones() -> None:
    ctx: Any = None
    with pytest.raises(ConfigError, match=r"unknown method 'nefl-xd' \(known: .*fedavg"):
        create_strategy("nefl-xd", ctx)
