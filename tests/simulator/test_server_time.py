"""The server's own time between a replay's rounds (`[run] server_time`): the virtual clock moves by it after
each round, availability is read at the moved clock, resume continues from it; and result observers."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from nestling.config import SimConfig, config_from_dict
from nestling.errors import ConfigError
from nestling.messages import Result, Task
from nestling.profiler.traces import DeviceTrace
from nestling.simulator import run as run_module
from nestling.simulator.reproduce_compute import ComputeMeter, read_compute
from nestling.simulator.run import run_simulation
from nestling.simulator.server_time import (
    FixedServerTime,
    MeasuredServerTime,
    RoundWork,
    read_server_time,
    writes_checkpoint,
)
from tests.simulator.replay_helpers import replay_config as shared_replay_config
from tests.simulator.replay_helpers import trace


def replay_config(tmp_path: Path, traces: list[DeviceTrace], rounds: int = 3, **run: Any) -> SimConfig:
    return shared_replay_config(tmp_path, traces, rounds=rounds, **run)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gaps(out: Path) -> list[float]:
    """Virtual seconds between each round's close and the next round's dispatch."""
    metrics = read_jsonl(out / "metrics.jsonl")
    return [b["dispatched_at"] - a["closed_at"] for a, b in itertools.pairwise(metrics)]


def steady_fleet(n: int = 3) -> list[DeviceTrace]:
    return [trace(f"t{i}", 0.02 * (i + 1)) for i in range(n)]


class TestModels:
    def test_fixed_adds_the_parts_of_the_rounds_that_do_them(self) -> None:
        model = FixedServerTime(round_s=0.5, eval_s=2.0, checkpoint_s=0.25)
        assert model.seconds(RoundWork(0, evaluated=False, checkpointed=False, measured_s=9.0)) == 0.5
        assert model.seconds(RoundWork(1, evaluated=True, checkpointed=True, measured_s=9.0)) == 2.75

    def test_measured_scales_what_this_process_measured(self) -> None:
        work = RoundWork(0, evaluated=True, checkpointed=False, measured_s=0.2)
        assert MeasuredServerTime(3.0).seconds(work) == pytest.approx(0.6)

    def test_checkpoint_rounds_follow_the_coordinators_rule(self) -> None:
        assert [writes_checkpoint(r, 5, 2) for r in range(5)] == [False, True, False, True, True]
        assert [writes_checkpoint(r, 3, 0) for r in range(3)] == [False, False, True]


@pytest.fixture
def no_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's PNGs (tested in test_replay_report.py) cost most of a tiny replay's seconds and say nothing
    about its clock: these runs skip drawing them."""
    monkeypatch.setattr(
        run_module, "write_replay_report", lambda out_dir, *_: out_dir / "report" / "index.html"
    )
    monkeypatch.setattr(run_module, "plot_accuracy", lambda out_dir, *_: out_dir / "accuracy.png")


@pytest.mark.usefixtures("no_plots")
class TestReplayClock:
    def test_fixed_moves_the_clock_by_each_rounds_parts(self, tmp_path: Path) -> None:
        cfg = replay_config(
            tmp_path,
            steady_fleet(),
            eval_every=2,
            checkpoint_every=2,
            server_time="fixed",
            server_round_s=0.5,
            server_eval_s=3.0,
            server_checkpoint_s=0.25,
        )
        summary = run_simulation(cfg, tmp_path / "run")
        # round 0: neither; round 1: evaluates and checkpoints (every 2); round 2 (the last) does both
        assert gaps(tmp_path / "run") == pytest.approx([0.5, 3.75])
        rows = read_server_time(tmp_path / "run")
        assert [row["server_s"] for row in rows] == pytest.approx([0.5, 3.75, 3.75])
        metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
        assert [row["closed_at"] for row in rows] == [
            m["closed_at"] for m in metrics
        ]  # records keep the close
        assert summary["replay"]["server_time"]["seconds"] == pytest.approx(8.0)

    def test_availability_is_read_at_the_moved_clock(self, tmp_path: Path) -> None:
        # Board 1 is online from 0 until `window` only. Without server time (the default) it is still online
        # when round 1 selects; with 2 s of it, round 1 selects after its window closed: only board 0 is asked.
        run_simulation(replay_config(tmp_path, steady_fleet(2), rounds=1), tmp_path / "steady")
        first_close = read_jsonl(tmp_path / "steady" / "metrics.jsonl")[0]["closed_at"]
        window = first_close + 1.0
        flaky = [trace("t0", 0.02), trace("t1", 0.04, availability=[[0.0, window]])]
        asked: dict[str, list[set[str]]] = {}
        settings: dict[str, dict[str, Any]] = {
            "none": {},
            "fixed": {"server_time": "fixed", "server_round_s": 2.0},
        }
        for mode, extra in settings.items():
            out = tmp_path / mode
            summary = run_simulation(replay_config(tmp_path, flaky, rounds=2, **extra), out)
            timeline = read_jsonl(out / "timeline.jsonl")
            asked[mode] = [{row["device_id"] for row in timeline if row["round"] == r} for r in (0, 1)]
            assert read_jsonl(out / "metrics.jsonl")[0]["closed_at"] == first_close
            assert summary["replay"]["server_time"]["mode"] == mode
        assert gaps(tmp_path / "none") == [0.0] and not (tmp_path / "none" / "server_time.jsonl").exists()
        assert gaps(tmp_path / "fixed") == [2.0]
        assert asked["none"] == [{"dev-00000", "dev-00001"}] * 2
        assert asked["fixed"] == [{"dev-00000", "dev-00001"}, {"dev-00000"}]

    def test_measured_moves_the_clock_by_the_scaled_wall_time_of_the_servers_work(
        self, tmp_path: Path
    ) -> None:
        cfg = replay_config(tmp_path, steady_fleet(), server_time="measured", server_time_factor=1000.0)
        run_simulation(cfg, tmp_path / "run")
        rows = read_server_time(tmp_path / "run")
        assert [row["round"] for row in rows] == [0, 1, 2]
        for row in rows:  # evaluating a model takes this process more than a microsecond
            assert row["measured_s"] > 1e-6 and row["server_s"] == pytest.approx(1000.0 * row["measured_s"])
        assert gaps(tmp_path / "run") == pytest.approx([row["server_s"] for row in rows[:2]])

    def test_a_resumed_replay_continues_after_the_server_time_of_its_last_round(self, tmp_path: Path) -> None:
        out = tmp_path / "run"
        fixed: dict[str, Any] = {"server_time": "fixed", "server_round_s": 1.5}
        run_simulation(replay_config(tmp_path, steady_fleet(), rounds=2, **fixed), out)
        run_simulation(replay_config(tmp_path, steady_fleet(), rounds=3, **fixed), out, resume=True)
        assert gaps(out) == pytest.approx([1.5, 1.5])
        assert [row["round"] for row in read_server_time(out)] == [0, 1, 2]


class TestConfig:
    @pytest.mark.parametrize(
        ("run", "message"),
        [
            (
                {"server_time": "wall"},
                r"\[run\] server_time must be one of none, fixed, measured, got 'wall'",
            ),
            ({"server_time": 1}, r"\[run\] server_time must be str"),
            ({"server_time": "fixed"}, r"needs at least one of server_round_s, server_eval_s"),
            ({"server_time": "fixed", "server_round_s": -1.0}, r"\[run\] server_round_s must be a finite"),
            (
                {"server_time": "fixed", "server_eval_s": float("nan")},
                r"\[run\] server_eval_s must be a finite",
            ),
            ({"server_time": "fixed", "server_round_s": "1s"}, r"\[run\] server_round_s must be float"),
            ({"server_time": "fixed", "server_round_s": True}, r"\[run\] server_round_s must be a number"),
            ({"server_round_s": 0.3}, r'server_round_s is used only with server_time = "fixed"'),
            (
                {"server_time": "fixed", "server_round_s": 0.3, "server_time_factor": 2.0},
                r'server_time_factor is used only with server_time = "measured"',
            ),
            (
                {"server_time": "measured", "server_time_factor": 0.0},
                r"server_time_factor must be a finite number > 0",
            ),
            (
                {"server_time": "measured", "server_checkpoint_s": 1.0},
                r"server_checkpoint_s is used only with",
            ),
        ],
    )
    def test_bad_settings_name_the_key(self, tmp_path: Path, run: dict[str, Any], message: str) -> None:
        with pytest.raises(ConfigError, match=message):
            replay_config(tmp_path, steady_fleet(), **run)

    def test_server_time_needs_a_replay(self) -> None:
        with pytest.raises(ConfigError, match=r"server_time = 'measured' moves a replay's virtual clock"):
            config_from_dict({"run": {"server_time": "measured"}})

    def test_whole_seconds_are_read_as_floats(self, tmp_path: Path) -> None:
        cfg = replay_config(tmp_path, steady_fleet(), server_time="fixed", server_checkpoint_s=2)
        assert cfg.run.server_checkpoint_s == 2.0 and isinstance(cfg.run.server_checkpoint_s, float)


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    newest = sorted((out / "checkpoints").glob("round-*"))[-1]
    return load_file(str(newest / "global.safetensors"))


@pytest.mark.usefixtures("no_plots")
class TestObservers:
    def test_observers_see_every_trained_result_and_change_no_weight(self, tmp_path: Path) -> None:
        cfg = replay_config(tmp_path, steady_fleet(4), fraction=0.5, rounds=2, over_selection=1.5)
        seen: list[tuple[int, str]] = []

        def watch(task: Task, result: Result) -> None:
            assert result.task_id == task.task_id
            seen.append((task.round, task.device_id))

        run_simulation(cfg, tmp_path / "plain")
        run_simulation(cfg, tmp_path / "observed", observers=[watch, ComputeMeter(tmp_path / "observed")])
        timeline = read_jsonl(tmp_path / "observed" / "timeline.jsonl")
        used = [(row["round"], row["device_id"]) for row in timeline if row["outcome"] == "used"]
        assert sorted(seen) == sorted(used) and len(used) == 4  # a cancelled straggler is never trained
        assert read_compute(tmp_path / "observed")["client_rounds"] == 4
        before, after = final_weights(tmp_path / "plain"), final_weights(tmp_path / "observed")
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    def test_a_run_without_traces_shows_its_observers_every_result(self, tmp_path: Path) -> None:
        cfg = replay_config(tmp_path, steady_fleet(4), fraction=0.5, rounds=2)
        cfg.run.traces = None
        meter = ComputeMeter(tmp_path / "run")
        run_simulation(cfg, tmp_path / "run", observers=[meter])
        metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
        assert read_compute(tmp_path / "run")["client_rounds"] == sum(m["accepted"] for m in metrics) == 4
