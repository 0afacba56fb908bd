"""benchmarks/fidelity.py: the comparison of simulated and fleet round durations (fast), and a tiny run of both (slow)."""

from __future__ import annotations

import re

import pytest

from benchmarks import fidelity
from nestling.edge.emulation import TaskPacing


def record(round_index: int, start: float, end: float) -> dict:
    return {"round": round_index, "dispatched_at": start, "closed_at": end, "virtual_time": end}


def test_round_durations_run_from_the_first_task_sent_to_the_close() -> None:
    # virtual clock in the simulator, monotonic wall clock on the fleet: only the differences count
    assert fidelity.round_durations([record(0, 0.0, 3.0), record(1, 3.0, 7.5)]) == {0: 3.0, 1: 4.5}
    assert fidelity.round_durations([record(0, 9727.2, 9730.2)]) == {0: pytest.approx(3.0)}


def test_errors_are_relative_to_the_simulators_prediction() -> None:
    rows = fidelity.compare({0: 2.0, 1: 4.0, 2: 5.0}, {0: 2.2, 1: 3.8, 2: 5.0})
    assert [round(r.error, 6) for r in rows] == [0.1, -0.05, 0.0]
    assert fidelity.error_summary(rows) == (pytest.approx(0.05), pytest.approx(0.1))
    assert fidelity.final_line(rows) == "median_abs_err=0.050 worst_err=0.100"
    text = fidelity.table(rows, {0: ["a", "b"]}, {0: "a (rpi4)"}, {0: 0.25})
    assert "| 0 | 2 | 2.000 | 2.200 | +0.100 | a (rpi4) | 0.250 |" in text


def test_rounds_must_match_and_take_time() -> None:
    with pytest.raises(ValueError, match="rounds differ"):
        fidelity.compare({0: 1.0, 1: 1.0}, {0: 1.0})
    with pytest.raises(ValueError, match="simulated duration"):
        fidelity.compare({0: 0.0}, {0: 1.0})


def test_the_agents_emulation_lines_are_read_back() -> None:
    pacing = TaskPacing(
        down_s=0.1, compute_s=2.5, up_s=0.2, slept_s=1.9, overrun_s=0.0, measured_compute_s=0.9
    )
    log = (
        f"2026-11-22 02:40:45,450 nestling.agent INFO {pacing.line(4, 'rpi4')}\n"
        "2026-11-22 02:40:45,461 nestling.agent INFO round 4: sent r4-dev-00002 for submodel 30f0 (1.11 MB)\n"
    )
    assert fidelity.parse_agent_log(log) == {
        4: {"down_s": 0.1, "compute_s": 2.5, "host_s": 0.9, "up_s": 0.2, "slept_s": 1.9, "overrun_s": 0.0}
    }


def test_both_worlds_share_method_seed_participation_deadline_and_quorum() -> None:
    args = fidelity.argparse.Namespace(
        devices=20,
        per_round=4,
        rounds=3,
        seed=1,
        deadline=60.0,
        dataset="digits",
        model="resnet20",
        method="fedavg",
        local_epochs=2,
        batch=32,
        lr=0.05,
    )
    shared = fidelity.shared_config(args)
    assert int(shared["train"]["fraction"] * 20) == 4
    assert shared["run"]["over_selection"] == 1.0 and shared["run"]["quorum"] == 1.0
    toml = fidelity.toml_tables({"run": shared["run"], "method": {"name": "fedavg", "flex": None}})
    assert "[run]\nrounds = 3\nseed = 1\n" in toml and 'name = "fedavg"\n' in toml and "flex" not in toml


@pytest.mark.slow
def test_a_tiny_replay_runs_in_both_worlds(tmp_path, capsys: pytest.CaptureFixture) -> None:
    assert (
        fidelity.main(
            [
                "--devices",
                "3",
                "--per-round",
                "2",
                "--rounds",
                "2",
                "--local-epochs",
                "1",
                "--settle",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "same devices every round in both worlds: yes" in out and "3 agents emulating rpi4" in out
    median, worst = map(
        float, re.fullmatch(r"median_abs_err=(\S+) worst_err=(\S+)", out.strip().splitlines()[-1]).groups()
    )
    assert 0 <= median <= worst < 1.0  # two short rounds: only that the runs line up, not the 10 % goal
