"""`nestling plan --fleet RUN_DIR`: the boards a run registered, planned by the run's own strategy exactly as
its server would plan the next round (profiles, hand-set budgets, pinned tiers, speed factors from checkpoints)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import nestling.profiler.demo_boards as demo_boards
from nestling.edge.emulation import EmulationTarget
from nestling.edge.self_profile import ProfileInputs, emulated_profile
from nestling.server.checkpoint import save_strategy_checkpoint
from nestling.server.enrolment import Enrolment
from nestling.server.fleet_plan import write_run_file
from nestling.server.plan_cli import plan_main
from nestling.server.registry import DeviceRegistry
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.server.strategies.base import Strategy

SAMPLES = 160


def demo_strategy(deadline_s: float = 30.0, train_share: float = 0.029 * SAMPLES / 30.0) -> Strategy:
    ctx = StrategyContext(
        "resnet20", 10, 1, 16, num_clients=6, total_rounds=4, local={"batch_size": 32, "local_steps": 5},
        options={"flex": 0}, deadline_s=deadline_s, train_share=train_share,
    )  # fmt: skip
    return create_strategy("nefl-wd", ctx)


def register_fleet(run: Path, strategy: Strategy) -> DeviceRegistry:
    """The demo's four emulated classes say hello with their profiles, plus a board with a hand-set budget
    and one whose tier the enrolment pins, through the server's registry (it writes registry.json)."""
    boards = [f"board-{index}" for index in range(len(demo_boards.DEMO_BOARDS))]
    enrolment = Enrolment.closed([*boards, "budgeted", "pinned"], {"pinned": 1})
    registry = DeviceRegistry(run / "registry.json", enrolment=enrolment)
    for index, board in enumerate(demo_boards.DEMO_BOARDS):
        inputs = ProfileInputs(strategy.full_spec.to_dict(), 32, "cpu", 0.2, board.name)
        profile = emulated_profile(inputs, EmulationTarget.of_board(board)).to_dict()
        hello = {"num_samples": 360, "index": index, "board_profile": profile}
        registry.register(f"board-{index}", hello, 0.0)
    registry.register("budgeted", {"num_samples": 360, "memory_budget_bytes": 11 * 2**20}, 0.0)
    registry.register("pinned", {"num_samples": 360}, 0.0)
    return registry


def planned(run: Path, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "plan.json"
    assert plan_main(["--fleet", str(run), "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_the_fleet_plan_is_what_the_runs_server_assigns_its_registered_boards(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    strategy = demo_strategy()
    registry = register_fleet(run, strategy)
    write_run_file(run, strategy)  # a run that has not checkpointed yet

    plan = planned(run, tmp_path)
    assert plan["schema"] == "nestling.fleet_plan/1" and plan["round"] == 0 and plan["from"] == "run.json"
    rows = {r["device"]: r for r in plan["devices"]}
    server = demo_strategy()  # what the server itself assigns these boards in round 0
    devices = sorted(registry.available(), key=lambda d: d.device_id)
    tasks = server.assign(0, devices)
    plans, _ = server.plan_report(0, devices, tasks)
    assert {d: r["spec"] for d, r in rows.items()} == {d: t.spec_id for d, t in tasks.items()}
    assert [rows[f"board-{i}"]["reason"] for i in range(4)] == [
        "time-bound",
        "time-bound",
        "memory-bound",
        "unconstrained",
    ]
    assert len({rows[f"board-{i}"]["spec"] for i in range(4)}) == 4
    assert rows["board-0"]["predicted_s"] == pytest.approx(plans["board-0"]["predicted_s"])
    assert rows["board-0"]["predicted_s"] <= plan["time_budget_s"] == pytest.approx(0.029 * SAMPLES)
    assert rows["budgeted"]["reason"] == "hand-set budget" and rows["budgeted"]["budget_bytes"] == 11 * 2**20
    assert rows["budgeted"]["memory_bytes"] <= 11 * 2**20 and rows["budgeted"]["predicted_s"] is None
    assert rows["pinned"]["reason"] == "pinned" and rows["pinned"]["submodel"] == "k2"

    # a longer deadline: the slow boards are planned larger, nothing else changes
    longer = {r["device"]: r for r in planned(run, tmp_path, "--deadline", "60")["devices"]}
    assert longer["board-0"]["memory_bytes"] > rows["board-0"]["memory_bytes"]
    assert longer["board-2"]["spec"] == rows["board-2"]["spec"]  # memory-bound either way


def test_a_checkpoint_brings_the_speed_factors_so_a_slowed_board_is_planned_smaller(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    strategy = demo_strategy()
    register_fleet(run, strategy)
    write_run_file(run, strategy)
    fresh = {r["device"]: r for r in planned(run, tmp_path)["devices"]}
    strategy.feedback.observe("board-3", 1.0, 2.0)  # the fast board was observed training 2x slower
    save_strategy_checkpoint(run / "checkpoints", 1, strategy, seed=0)
    plan = planned(run, tmp_path)
    rows = {r["device"]: r for r in plan["devices"]}
    assert plan["round"] == 2 and plan["from"] == "checkpoint round-000001"
    assert rows["board-3"]["speed"] == 2.0 and rows["board-3"]["reason"] == "time-bound"
    assert rows["board-3"]["memory_bytes"] < fresh["board-3"]["memory_bytes"]
    assert rows["board-3"]["predicted_s"] <= plan["time_budget_s"]
    assert {d: r["spec"] for d, r in rows.items() if d != "board-3"} == {
        d: r["spec"] for d, r in fresh.items() if d != "board-3"
    }


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "no such run folder"),
        ("empty", "neither checkpoints/ nor run.json"),
        ("no-registry", "no registry.json"),
        ("bad-profile", "device 'board-0'"),
    ],
)
def test_a_run_folder_that_cannot_be_planned_is_named(
    tmp_path: Path, capsys, setup: str, message: str
) -> None:
    run = tmp_path / "run"
    if setup != "missing":
        run.mkdir()
    if setup in ("no-registry", "bad-profile"):
        write_run_file(run, demo_strategy())
    if setup == "bad-profile":
        register_fleet(run, demo_strategy()).compact()  # the snapshot a server leaves when it stops
        stored = json.loads((run / "registry.json").read_text())
        stored["devices"]["board-0"]["board_profile"]["gflops"] = -1.0
        (run / "registry.json").write_text(json.dumps(stored))
    assert plan_main(["--fleet", str(run)]) == 2
    assert message in capsys.readouterr().out
