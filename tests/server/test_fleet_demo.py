"""`nestling demo`: one command starts broker, server and four agents and prints the per-submodel table."""

from __future__ import annotations

import json

import pytest

from nestling.server.fleet_demo import demo_main


@pytest.mark.slow
def test_the_demo_runs_a_fleet_and_prints_each_submodels_accuracy(tmp_path, capsys):
    assert demo_main(["--model", "resnet20", "--rounds", "2", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert (
        "NeFL-WD on a 4-board fleet" in printed
        and "board-0 (9 MB)" in printed
        and "board-3 (24 MB)" in printed
    )
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["transport"]["accepted"] == 8
    assert len(summary["trained_by"]) == 4  # four budgets, four different submodels
