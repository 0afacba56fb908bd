"""Trace replay: results arrive at virtual times, dropouts when devices leave, only used results are trained,
and `nestling simulate --traces` drives the one coordinator on a virtual clock end to end."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nestling.config import config_from_dict
from nestling.errors import ConfigError
from nestling.messages import Result, Task
from nestling.models.config import ModelConfig
from nestling.profiler.traces import DeviceTrace, save_traces
from nestling.server.clock import VirtualClock
from nestling.server.strategies.base import DeviceInfo
from nestling.simulator.durations import Arrival
from nestling.simulator.inprocess import InProcessTransport
from nestling.simulator.replay import TraceReplay, fleet_size
from nestling.simulator.run import run_simulation
from nestling.spec import SubmodelSpec


@dataclass
class RecordingBackend:
    """Returns an empty result per task and remembers which tasks were actually trained."""

    trained: list[str] = field(default_factory=list)

    def run(self, tasks: list[Task]) -> list[Result]:
        self.trained.extend(t.device_id for t in tasks)
        return [Result(t.round, t.device_id, t.task_id, "spec", {}, 1) for t in tasks]

    def close(self) -> None:
        pass


@dataclass
class ScriptedFleet:
    """Fixed arrivals per device; devices listed in `offline` are offline until `back_at`."""

    arrivals: dict[str, Arrival]
    offline: set[str] = field(default_factory=set)
    back_at: float = float("inf")

    def online(self, device: DeviceInfo, t: float) -> DeviceInfo | None:
        return None if device.device_id in self.offline and t < self.back_at else device

    def next_online(self, device: DeviceInfo, t: float) -> float:
        return self.back_at if device.device_id in self.offline and t < self.back_at else t

    def arrival(self, task: Task, t: float) -> Arrival:
        return self.arrivals[task.device_id]


def devices(n: int) -> list[DeviceInfo]:
    return [DeviceInfo(f"d{i}", i, 10) for i in range(n)]


SPEC = SubmodelSpec(ModelConfig("tinycnn", num_classes=4, in_channels=3, image_size=8)).to_dict()


def tasks_for(names: list[str], round_index: int = 0) -> list[Task]:
    return [Task(round_index, name, SPEC, {}, "sgd", task_id=f"r{round_index}-{name}") for name in names]


def transport(arrivals: dict[str, Arrival], **fleet: object) -> tuple[InProcessTransport, RecordingBackend]:
    backend = RecordingBackend()
    return InProcessTransport(
        devices(len(arrivals)), backend, VirtualClock(), ScriptedFleet(arrivals, **fleet)
    ), backend


class TestTransport:
    def test_results_arrive_in_time_order_and_only_wanted_ones_are_trained(self) -> None:
        link, backend = transport({"d0": Arrival(30.0), "d1": Arrival(10.0), "d2": Arrival(20.0)})
        link.dispatch(tasks_for(["d0", "d1", "d2"]))
        delivery = link.wait(deadline=float("inf"), want=2)
        assert [r.device_id for r in delivery.results] == ["d1", "d2"]
        assert backend.trained == ["d1", "d2"] and link.clock is not None and link.clock.now() == 20.0
        link.cancel(0)
        assert link.idle() and backend.trained == ["d1", "d2"]  # the straggler is never trained
        assert {e.device_id: e.outcome for e in link.drain_events()} == {
            "d0": "cancelled",
            "d1": "used",
            "d2": "used",
        }

    def test_dropouts_are_reported_when_the_device_leaves(self) -> None:
        link, _ = transport(
            {"d0": Arrival(5.0, dropped=True), "d1": Arrival(10.0), "d2": Arrival(50.0, dropped=True)}
        )
        link.dispatch(tasks_for(["d0", "d1", "d2"]))
        first = link.wait(deadline=float("inf"), want=1)
        assert first.dropped == ["d0"] and [r.device_id for r in first.results] == ["d1"]
        second = link.wait(deadline=float("inf"), want=1)
        assert second.dropped == ["d2"] and not second.results and link.idle()
        assert link.clock is not None and link.clock.now() == 50.0

    def test_a_deadline_with_nothing_due_moves_the_clock_to_the_deadline(self) -> None:
        link, backend = transport({"d0": Arrival(100.0)})
        link.dispatch(tasks_for(["d0"]))
        delivery = link.wait(deadline=60.0, want=1)
        assert not delivery.results and not backend.trained
        assert link.clock is not None and link.clock.now() == 60.0 and not link.idle()

    def test_with_nobody_online_the_server_idles_until_someone_is(self) -> None:
        link, _ = transport({"d0": Arrival(1.0), "d1": Arrival(1.0)}, offline={"d0", "d1"}, back_at=3600.0)
        assert [d.device_id for d in link.devices()] == ["d0", "d1"]
        assert link.clock is not None and link.clock.now() == 3600.0

    def test_a_fleet_needs_a_virtual_clock(self) -> None:
        with pytest.raises(ValueError, match="virtual clock"):
            InProcessTransport(devices(1), RecordingBackend(), None, ScriptedFleet({}))


def make_trace(name: str, cls: str = "rpi4", **overrides: object) -> DeviceTrace:
    fields: dict[str, object] = {
        "device_id": name,
        "device_class": cls,
        "memory_budget_bytes": 2**30,
        "up_bps": 1e6,
        "down_bps": 1e6,
        "latency_s": 0.01,
        "gflops": 0.05,
    }
    fields.update(overrides)
    return DeviceTrace(**fields)  # type: ignore[arg-type]


class TestTraceReplay:
    def test_devices_replay_traces_in_order_and_traces_repeat(self) -> None:
        replay = TraceReplay(devices(5), [make_trace("a"), make_trace("b", "phone-mid")], (3, 8, 8))
        assert [replay.trace_of(d.device_id).device_id for d in replay.devices] == ["a", "b", "a", "b", "a"]
        assert replay.devices[1].profile == {"device_class": "phone-mid", "trace": "b"}
        assert fleet_size(clients=20, traces=7) == 20 and fleet_size(clients=5, traces=12) == 12

    def test_budgets_follow_the_schedule(self) -> None:
        replay = TraceReplay(devices(1), [make_trace("a", budget_schedule=[[100, 2**20]])], (3, 8, 8))
        device = replay.devices[0]
        assert replay.online(device, 50.0) is device
        later = replay.online(device, 150.0)
        assert later is not None and later.memory_budget_bytes == 2**20

    def test_offline_devices_are_not_offered(self) -> None:
        replay = TraceReplay(devices(1), [make_trace("a", availability=[[10, 20]])], (3, 8, 8))
        assert replay.online(replay.devices[0], 5.0) is None
        assert replay.next_online(replay.devices[0], 5.0) == 10.0

    def test_a_device_at_the_closing_instant_of_its_window_is_leaving(self) -> None:
        # Online in [4, 10] every 10 s, and [0, 0] (an instant): at t = 0 and t = 10 it is only closing.
        trace = make_trace("a", availability=[[0, 0], [4, 10]], period_s=10.0)
        replay = TraceReplay(devices(1), [trace], (3, 8, 8))
        device = replay.devices[0]
        assert trace.is_available(10.0) and replay.online(device, 10.0) is None
        assert replay.next_online(device, 10.0) == 14.0
        assert replay.online(device, 14.0) is device


def replay_config(tmp_path: Path, traces: list[DeviceTrace], **run: object) -> object:
    path = tmp_path / "fleet.jsonl"
    save_traces(traces, path)
    return config_from_dict(
        {
            "run": {
                "rounds": 3,
                "eval_every": 1,
                "workers": 1,
                "traces": str(path),
                "checkpoint_every": 1,
                **run,
            },
            "data": {"dataset": "digits", "clients": 6, "limit_train": 300, "limit_test": 100},
            "model": {"arch": "tinycnn"},
            "method": {"name": "fedavg"},
            "train": {"fraction": 0.5, "local_steps": 2, "batch_size": 16},
        }
    )


def fleet(n: int = 6, **overrides: object) -> list[DeviceTrace]:
    classes = ["rpi4", "phone-mid", "laptop"]
    return [make_trace(f"t{i}", classes[i % 3], gflops=0.02 * (i + 1), **overrides) for i in range(n)]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class TestSimulateWithTraces:
    def test_a_replay_runs_on_virtual_time_and_writes_timeline_summary_and_report(
        self, tmp_path: Path
    ) -> None:
        cfg = replay_config(tmp_path, fleet(), over_selection=1.5)
        summary = run_simulation(cfg, tmp_path / "run")  # type: ignore[arg-type]
        metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
        times = [m["virtual_time"] for m in metrics]
        assert times == sorted(times) and times[0] > 0
        timeline = read_jsonl(tmp_path / "run" / "timeline.jsonl")
        assert {row["round"] for row in timeline} == {0, 1, 2}
        for row in timeline:  # the trace file's own ids are kept beside the run's dev-NNNNN
            assert row["trace_device"] == f"t{int(row['device_id'].rsplit('-', 1)[1]) % 6}"
        for record in metrics:  # 3 needed, 5 dispatched (x1.5 over-selection): 2 stragglers never used
            rows = [row for row in timeline if row["round"] == record["round"]]
            assert len(rows) == 5 and sum(row["outcome"] == "used" for row in rows) == record["accepted"] == 3
            assert max(row["ends_at"] for row in rows if row["outcome"] == "used") == record["virtual_time"]
        assert summary["virtual_seconds"] == times[-1]
        assert summary["replay"]["devices"] == 6 and summary["replay"]["outcomes"]["cancelled"] == 6
        assert (tmp_path / "run" / "report" / "index.html").exists()

    def test_devices_that_leave_mid_task_are_dropouts_and_the_deadline_closes_the_round(
        self, tmp_path: Path
    ) -> None:
        traces = fleet(availability=[[0, 0.5]])  # everyone leaves after half a second: no task can finish
        cfg = replay_config(tmp_path, traces, rounds=1, deadline_s=30.0)
        run_simulation(cfg, tmp_path / "run")  # type: ignore[arg-type]
        record = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
        assert record["accepted"] == 0 and not record["aggregated"]
        assert record["counters"]["dropouts"] == 3 and record["counters"]["rounds_below_quorum"] == 1
        rows = read_jsonl(tmp_path / "run" / "timeline.jsonl")
        assert all(row["outcome"] == "dropped" and row["ends_at"] == 0.5 for row in rows)

    def test_a_resumed_replay_continues_the_virtual_clock(self, tmp_path: Path) -> None:
        out = tmp_path / "run"
        run_simulation(replay_config(tmp_path, fleet(), rounds=2), out)  # type: ignore[arg-type]
        first = read_jsonl(out / "metrics.jsonl")
        run_simulation(replay_config(tmp_path, fleet(), rounds=3), out, resume=True)  # type: ignore[arg-type]
        metrics = read_jsonl(out / "metrics.jsonl")
        assert [m["round"] for m in metrics] == [0, 1, 2]
        assert metrics[2]["virtual_time"] > first[1]["virtual_time"]
        assert {row["round"] for row in read_jsonl(out / "timeline.jsonl")} == {0, 1, 2}

    def test_more_traces_than_clients_gives_one_device_per_trace(self, tmp_path: Path) -> None:
        summary = run_simulation(replay_config(tmp_path, fleet(9), rounds=1), tmp_path / "run")  # type: ignore[arg-type]
        assert summary["replay"]["devices"] == 9
        assert summary["replay"]["outcomes"]["used"] == 4  # fraction 0.5 of 9 devices

    def test_unknown_backend_is_a_config_error(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match="backend must be one of"):
            replay_config(tmp_path, fleet(), backend="mpi")
