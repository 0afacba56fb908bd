"""`nestling plan` dispatches on the Plannable capability: a method plans by implementing it, never by a name."""

from __future__ import annotations

from pathlib import Path

import pytest

from nestling.errors import ConfigError
from nestling.profiler.planner import DeviceBudget
from nestling.server.plan_cli import plan_main
from nestling.server.plan_methods import plan_rows, plannable_methods
from nestling.server.strategies import STRATEGIES
from nestling.server.strategies.fedavg import FedAvg
from nestling.server.strategies.planning import FamilyPlanning
from nestling.spec import SubmodelSpec

MIB = 1024 * 1024


class HalfOrFull(FamilyPlanning, FedAvg):
    """A test method whose family is the half-width and the full model."""

    name = "lab-half-or-full"

    def family(self) -> tuple[list[str], list[SubmodelSpec]]:
        return ["half", "full"], [SubmodelSpec(self.model, width=0.5), self.full_spec]


def test_a_method_plans_by_implementing_plannable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(STRATEGIES, HalfOrFull.name, HalfOrFull)
    assert plannable_methods()[HalfOrFull.name] == "family"
    shape = {"batch": 8, "shape": (3, 8, 8), "classes": 4}
    (smallest,), _ = plan_rows(HalfOrFull.name, "tinycnn", [DeviceBudget("none", 1)], **shape)  # type: ignore[arg-type]
    (largest,), _ = plan_rows(HalfOrFull.name, "tinycnn", [DeviceBudget("all", 2**40)], **shape)  # type: ignore[arg-type]
    assert (smallest.label, smallest.fits, largest.label) == ("half", False, "full")
    between = (smallest.memory_bytes + largest.memory_bytes) // 2
    devices = [DeviceBudget("small", between), DeviceBudget("large", largest.memory_bytes)]
    rows, facts = plan_rows(HalfOrFull.name, "tinycnn", devices, **shape)  # type: ignore[arg-type]
    assert [row.label for row in rows] == ["half", "full"] and facts == {}
    assert all(row.fits for row in rows)


def test_a_method_without_the_capability_is_refused_by_name() -> None:
    devices = [DeviceBudget("board", 40 * MIB)]
    with pytest.raises(
        ConfigError, match=r"\[plan\] method 'fedavg' has nothing to plan \(plannable: fedepth"
    ):
        plan_rows("fedavg", "tinycnn", devices)
    with pytest.raises(ConfigError, match="has nothing to plan"):
        plan_rows("no-such-method", "tinycnn", devices)
    with pytest.raises(ConfigError, match="no devices"):
        plan_rows("nefl-wd", "tinycnn", [])


def test_a_bad_option_is_printed_with_its_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rich markup must not eat the '[method]' that names where the option belongs."""
    argv = ["--budget-mb", "12", "--method", "nefl-wd", "--model", "tinycnn", "--option", "flex=1.5"]
    assert plan_main([*argv, "--out", str(tmp_path / "plan.json")]) == 2
    assert "[method] nefl-wd option flex must be int, got 1.5" in capsys.readouterr().out
    assert not (tmp_path / "plan.json").exists()
