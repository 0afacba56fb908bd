"""`nestling demo`: one command starts broker, server and four emulating agents, sizes each board from the
profile it reports (no budget typed) and prints the per-submodel and per-board plan tables."""

from __future__ import annotations

import json

import pytest

from nestling.errors import NestlingError
from nestling.profiler.catalogue import get_board
from nestling.server.fleet_demo import BOARD_CLASSES, demo_main, train_share
from nestling.server.plan_cli import plan_main


@pytest.mark.slow
def test_the_demo_sizes_each_emulated_board_from_its_profile_onto_its_own_submodel(tmp_path, capsys):
    assert (
        demo_main(["--model", "resnet20", "--rounds", "2", "--local-steps", "3", "--out", str(tmp_path)]) == 0
    )
    printed = capsys.readouterr().out
    assert "NeFL-WD on a 4-board fleet" in printed and "board-0 (demo-slow)" in printed
    assert "planned to train, from the profile it reported" in printed
    assert not any("memory_budget" in p.read_text() for p in tmp_path.glob("agent-*.toml"))  # none typed

    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["aggregated"] for r in records)
    first = records[0]["plans"]  # round 0: nothing observed yet, the plan is the profiles' alone
    assert sorted(first) == [f"board-{i}" for i in range(4)]
    assert len({first[f"board-{i}"]["spec"] for i in range(4)}) == 4  # four classes, four submodels
    for index, name in enumerate(BOARD_CLASSES):
        plan = first[f"board-{index}"]
        assert plan["source"] == f"emulated:{name}" and plan["speed"] == 1.0
        # the memory the board reported: its class's training memory less the agent's 20 % safety margin
        assert plan["budget_bytes"] == int(get_board(name).memory_budget_bytes * 0.8)
        assert 0 < plan["predicted_s"] <= plan["time_budget_s"] or plan["reason"] == "fallback"
    reasons = [first[f"board-{i}"]["reason"] for i in range(4)]
    assert reasons == ["time-bound", "time-bound", "memory-bound", "unconstrained"]

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["transport"]["accepted"] >= 6
    assert sorted(summary["plans"]) == sorted(first) and summary["plans"]["board-3"]["rounds"] == 2
    assert summary["config"]["run"]["train_share"] == train_share(3)

    # what the server would assign next: the same boards, from the run's checkpoint and registry.json
    assert plan_main(["--fleet", str(tmp_path / "out"), "--out", str(tmp_path / "next.json")]) == 0
    following = json.loads((tmp_path / "next.json").read_text())
    assert following["round"] == 2 and following["from"] == "checkpoint round-000001"
    assert sorted(r["device"] for r in following["devices"]) == sorted(first)
    assert all(r["predicted_s"] > 0 and r["source"].startswith("emulated:") for r in following["devices"])


def test_the_demo_refuses_steps_that_plan_past_its_deadline():
    with pytest.raises(NestlingError, match="local-steps"):
        train_share(10_000)
    with pytest.raises(NestlingError, match="local-steps must be >= 1"):
        train_share(0)
