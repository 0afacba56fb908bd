"""A method's options are one typed record: built once from the [method] table, values in their declared types,
wrong keys and wrong kinds refused by name."""

from __future__ import annotations

import math
from dataclasses import FrozenInstanceError, dataclass

import pytest

from nestling.errors import ConfigError
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.server.strategies.options import MethodOptions


@dataclass(frozen=True)
class LabOptions(MethodOptions):
    ratio: float = 0.5
    count: int = 2
    on: bool = False
    name: str = "a"
    widths: tuple[float, ...] = (0.25, 1.0)
    cap: int | None = None
    window: int | str = "auto"


def test_a_table_becomes_the_record_with_values_in_their_declared_types() -> None:
    record = LabOptions.from_table("lab", {"ratio": 1, "widths": [1, 0.5], "cap": 3, "window": 7})
    assert record == LabOptions(ratio=1.0, widths=(1.0, 0.5), cap=3, window=7)
    assert isinstance(record.ratio, float) and all(isinstance(w, float) for w in record.widths)
    assert LabOptions.from_table("lab", {}) == LabOptions()
    with pytest.raises(FrozenInstanceError):
        record.ratio = 2.0  # type: ignore[misc]


def test_defaults_live_on_the_record_only() -> None:
    assert LabOptions.defaults() == {
        "ratio": 0.5,
        "count": 2,
        "on": False,
        "name": "a",
        "widths": (0.25, 1.0),
        "cap": None,
        "window": "auto",
    }


@pytest.mark.parametrize(
    ("key", "value", "takes"),
    [
        ("ratio", True, "int or float"),  # bool is no number
        ("ratio", math.nan, "int or float"),
        ("ratio", math.inf, "int or float"),
        ("ratio", "0.5", "int or float"),
        ("count", 1.5, "int"),
        ("count", False, "int"),
        ("on", 1, "bool"),
        ("name", 3, "str"),
        ("widths", 0.5, "a list of numbers"),
        ("widths", [0.5, "1"], "a list of numbers"),
        ("widths", [True], "a list of numbers"),
        ("cap", 2.0, "int or None"),
        ("window", 1.5, "int or str"),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused_naming_the_option(key: str, value: object, takes: str) -> None:
    with pytest.raises(ConfigError) as raised:
        LabOptions.from_table("lab", {key: value})
    assert str(raised.value) == f"[method] lab option {key} must be {takes}, got {value!r}"


def test_an_unknown_option_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"\[method\] lab has no options \['rato'\] \(known: cap, count, name, on"
    ):
        LabOptions.from_table("lab", {"rato": 0.5, "count": 3})
    with pytest.raises(ConfigError, match=r"has no options \['x'\] \(known: none\)"):
        MethodOptions.from_table("plain", {"x": 1})


def test_a_strategy_reads_its_record_and_keeps_the_table_for_its_checkpoints() -> None:
    """The run's table is recorded as given (checkpoint manifests, export); the strategy reads typed values."""
    ctx = StrategyContext("resnet20", 10, 3, 32, 4, 2, options={"flex": 1, "step_init": "do"})
    strategy = create_strategy("nefl-wd", ctx)
    assert strategy.options.flex == 1 and strategy.options.step_init == "do"  # type: ignore[attr-defined]
    assert ctx.to_record()["options"] == {"flex": 1, "step_init": "do"}
    with pytest.raises(ConfigError, match=r"\[method\] nefl-wd option flex must be int, got 1.5"):
        create_strategy("nefl-wd", StrategyContext("resnet20", 10, 3, 32, 4, 2, options={"flex": 1.5}))


def test_m_fedepth_inherits_fedepths_options_with_its_own_defaults() -> None:
    from nestling.server.strategies.fedepth import FeDepth, MFeDepth

    assert MFeDepth.option_defaults == {**FeDepth.option_defaults, "budgets": "surplus", "max_models": 2}
