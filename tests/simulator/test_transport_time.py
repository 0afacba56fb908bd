"""The fleet transport's time inside a replay's round (`[run] transport_time`): the server's serial dispatch, a
broker hop each way and the result's collection delay each task by what the model says, on the real replay."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nestling.config import SimConfig, config_from_dict
from nestling.errors import ConfigError
from nestling.messages import Task
from nestling.profiler.traces import DeviceTrace
from nestling.simulator import run as run_module
from nestling.simulator.run import run_simulation
from nestling.simulator.transport_time import TransportTime, transport_time_for
from tests.simulator.replay_helpers import replay_config as shared_replay_config
from tests.simulator.replay_helpers import trace


def replay_config(tmp_path: Path, traces: list[DeviceTrace], rounds: int = 2, **run: Any) -> SimConfig:
    return shared_replay_config(tmp_path, traces, rounds=rounds, **run)


def timeline(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines() if line.strip()]


def task_of(nbytes: int) -> Task:
    return Task(0, "d", {}, {"w": torch.zeros(nbytes // 4)}, "standard")


@pytest.fixture
def no_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's PNGs cost most of a tiny replay's seconds and say nothing about its clock."""
    monkeypatch.setattr(
        run_module, "write_replay_report", lambda out_dir, *_: out_dir / "report" / "index.html"
    )
    monkeypatch.setattr(run_module, "plot_accuracy", lambda out_dir, *_: out_dir / "accuracy.png")


class TestModel:
    def test_tasks_reach_their_boards_one_after_another(self) -> None:
        model = TransportTime(dispatch_s=0.1, dispatch_s_per_mb=0.5, hop_s=0.02)
        reach = model.reach_s([task_of(2_000_000), task_of(400_000), task_of(2_000_000)])
        assert reach == pytest.approx([1.1 + 0.02, 1.1 + 0.3 + 0.02, 1.1 + 0.3 + 1.1 + 0.02])

    def test_a_result_comes_back_a_hop_and_its_collection_later(self) -> None:
        model = TransportTime(hop_s=0.02, collect_s_per_mb=0.25)
        assert model.return_s(task_of(4_000_000)) == pytest.approx(0.02 + 1.0)

    def test_none_is_all_zero(self, tmp_path: Path) -> None:
        cfg = replay_config(tmp_path, [trace("a", 0.05)])
        assert transport_time_for(cfg.run) == TransportTime() and TransportTime().mode == "none"


@pytest.mark.usefixtures("no_plots")
class TestReplay:
    def test_the_kth_task_arrives_later_by_the_costs_before_it(self, tmp_path: Path) -> None:
        fleet = [trace(f"t{i}", 0.02 * (i + 1)) for i in range(3)]
        run_simulation(replay_config(tmp_path, fleet), tmp_path / "none")
        costs: dict[str, Any] = {
            "transport_dispatch_s": 0.5,
            "transport_hop_s": 0.125,
            "transport_collect_s_per_mb": 2.0,
        }
        cfg = replay_config(tmp_path, fleet, transport_time="fixed", **costs)
        run_simulation(cfg, tmp_path / "fixed")
        plain, delayed = timeline(tmp_path / "none"), timeline(tmp_path / "fixed")
        assert [r["device_id"] for r in plain] == [r["device_id"] for r in delayed]
        for r in range(2):
            rows = [(a, b) for a, b in zip(plain, delayed, strict=True) if a["round"] == r]
            for k, (a, b) in enumerate(rows):  # timeline rows are in dispatch order
                assert b["reach_s"] == pytest.approx(0.5 * (k + 1) + 0.125)
                assert b["return_s"] > 0.125  # the hop and the result's megabytes collected
                shift = (b["ends_at"] - b["dispatched_at"]) - (a["ends_at"] - a["dispatched_at"])
                assert shift == pytest.approx(b["reach_s"] + b["return_s"])
                assert a["reach_s"] == a["return_s"] == 0.0
        summary = json.loads((tmp_path / "fixed" / "summary.json").read_text())
        assert "transport_time" in json.dumps(summary)

    def test_availability_is_read_when_the_task_reaches_its_board(self, tmp_path: Path) -> None:
        fleet = [trace("stays", 0.05), trace("leaves", 0.5, availability=((0.0, 0.3), (1000.0, 2000.0)))]
        # The board online until 0.3 s is given its task at 0.0 + 0.5 s: too late, it has left.
        run_simulation(replay_config(tmp_path, fleet, rounds=1, deadline_s=60.0), tmp_path / "none")
        cfg = replay_config(
            tmp_path, fleet, rounds=1, deadline_s=60.0, transport_time="fixed", transport_dispatch_s=0.5
        )
        run_simulation(cfg, tmp_path / "fixed")
        before = {r["trace_device"]: r for r in timeline(tmp_path / "none")}
        after = {r["trace_device"]: r for r in timeline(tmp_path / "fixed")}
        assert after["leaves"]["outcome"] == "dropped" and after["stays"]["outcome"] == "used"
        assert before["leaves"]["ends_at"] <= 0.3  # without the transport it trained until it left


class TestConfig:
    @pytest.mark.parametrize(
        ("run", "message"),
        [
            ({"transport_time": "modelled"}, r"\[run\] transport_time must be one of none, fixed"),
            (
                {"transport_time": "fixed"},
                r'transport_time = "fixed" needs at least one of transport_dispatch_s',
            ),
            (
                {"transport_time": "fixed", "transport_hop_s": -0.1},
                r"\[run\] transport_hop_s must be a finite number >= 0",
            ),
            (
                {"transport_time": "fixed", "transport_dispatch_s": float("inf")},
                r"\[run\] transport_dispatch_s must be a finite number >= 0",
            ),
            (
                {"transport_time": "fixed", "transport_dispatch_s_per_mb": "1s"},
                r"\[run\] transport_dispatch_s_per_mb must be float",
            ),
            ({"transport_time": 1}, r"\[run\] transport_time must be str"),
            (
                {"transport_collect_s_per_mb": 0.3},
                r'transport_collect_s_per_mb is used only with transport_time = "fixed"',
            ),
        ],
    )
    def test_bad_settings_name_the_key(self, tmp_path: Path, run: dict[str, Any], message: str) -> None:
        with pytest.raises(ConfigError, match=message):
            replay_config(tmp_path, [trace("a", 0.05)], **run)

    def test_transport_time_needs_a_replay(self) -> None:
        with pytest.raises(ConfigError, match=r"transport_time = 'fixed' delays a replay's tasks"):
            config_from_dict({"run": {"transport_time": "fixed", "transport_hop_s": 0.01}})
