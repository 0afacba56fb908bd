"""The one round loop: seeded selection, over-selection, admission of results, quorum, persistence, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nestling.config import config_from_dict
from nestling.messages import Result, Task
from nestling.server.checkpoint import latest_checkpoint, load_checkpoint
from nestling.server.clock import VirtualClock
from nestling.server.coordinator import Coordinator, RoundPolicy
from nestling.server.screening import RobustPolicy
from nestling.server.strategies import DeviceInfo, create_strategy
from nestling.server.transport import Delivery
from tests.server.round_helpers import fleet, result_for


class ScriptedTransport:
    """Delivers, per wait(), whatever `respond(tasks)` returns for the round's dispatched tasks."""

    def __init__(self, devices: list[DeviceInfo], respond) -> None:
        self._devices = devices
        self.respond = respond
        self.dispatched: list[list[Task]] = []
        self.pending: list[Result] | None = None

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    def dispatch(self, tasks: list[Task]) -> None:
        self.dispatched.append(tasks)
        self.pending = self.respond(tasks)

    def wait(self, deadline: float, want: int) -> Delivery:
        results, self.pending = self.pending or [], []
        return Delivery(results=results)

    def idle(self) -> bool:
        return not self.pending

    def cancel(self, round_index: int) -> None:
        self.pending = []


def coordinator(make_ctx, respond, *, clients: int = 10, tmp: Path | None = None, **policy) -> Coordinator:
    strategy = create_strategy("fedavg", make_ctx(num_clients=clients))
    values = {"rounds": 3, "fraction": 0.5, "seed": 7}
    values.update(policy)
    return Coordinator(
        strategy, ScriptedTransport(fleet(clients), respond), VirtualClock(), None, RoundPolicy(**values), tmp
    )


def every_task(tasks: list[Task]) -> list[Result]:
    return [result_for(t) for t in tasks]


def test_selection_is_reproducible_per_seed_and_round(make_ctx) -> None:
    a, b = coordinator(make_ctx, every_task), coordinator(make_ctx, every_task)
    devices = fleet(10)
    picks = [[d.device_id for d in a.select(r, devices)] for r in range(6)]
    assert picks == [[d.device_id for d in b.select(r, devices)] for r in range(6)]
    assert picks[2] == [
        d.device_id for d in a.select(2, list(reversed(devices)))
    ]  # arrival order is irrelevant
    assert all(len(p) == 5 == len(set(p)) for p in picks)
    assert len({tuple(p) for p in picks}) > 1
    other = coordinator(make_ctx, every_task, seed=8)
    assert [[d.device_id for d in other.select(r, devices)] for r in range(6)] != picks


def test_over_selection_dispatches_ceil_1_3_m_and_keeps_m(make_ctx) -> None:
    coord = coordinator(make_ctx, every_task, over_selection=1.3)
    seen: list[int] = []
    original = coord.strategy.aggregate
    coord.strategy.aggregate = lambda r, accepted: (seen.append(len(accepted)), original(r, accepted))  # type: ignore
    record = coord.run_round(0)
    assert len(coord.transport.dispatched[0]) == 7  # ceil(1.3 · 5)
    assert record.selected == 7 and record.accepted == 5 and seen == [5]
    assert record.counters["late"] == 2


def test_duplicate_stale_unknown_and_invalid_results_are_counted_and_never_applied(make_ctx) -> None:
    def respond(tasks: list[Task]) -> list[Result]:
        a, b, c = tasks
        poisoned = result_for(b, 1000.0)
        poisoned.weights["head.fc.bias"][0] = float("nan")
        return [
            result_for(a, 1.0),
            result_for(a, 1000.0),
            result_for(a, 1000.0, round=5),
            result_for(a, 1000.0, task_id="r0-nobody"),
            result_for(a, 1000.0, device_id="dev-00009", task_id="x"),
            result_for(b, 1000.0, device_id="dev-00009"),
            poisoned,
            result_for(b, 2.0),
            result_for(c, 3.0),
        ]

    coord = coordinator(make_ctx, respond, clients=3, fraction=1.0)
    record = coord.run_round(0)
    assert record.accepted == 3 and record.aggregated
    counted = {k: v for k, v in record.counters.items() if v}
    assert counted == {"duplicate": 1, "future": 1, "unknown_task": 3, "rejected_invalid": 1}  # round 5 > 0
    state = coord.strategy.global_state
    expected = (10 * 1.0 + 10 * 2.0 + 10 * 3.0) / 30  # FedAvg of the three valid results, equal sample counts
    assert all(
        torch.allclose(v, torch.full_like(v, expected)) for v in state.values() if v.is_floating_point()
    )
    assert coord.totals["duplicate"] == 1


def test_below_quorum_the_model_is_unchanged(make_ctx) -> None:
    coord = coordinator(
        make_ctx, lambda tasks: [result_for(t, 9.0) for t in tasks[:2]], clients=3, fraction=1.0
    )
    before = {k: v.clone() for k, v in coord.strategy.global_state.items()}
    record = coord.run_round(0)
    assert not record.aggregated and record.accepted == 2 and record.counters["rounds_below_quorum"] == 1
    assert all(torch.equal(v, before[k]) for k, v in coord.strategy.global_state.items())
    relaxed = coordinator(
        make_ctx, lambda tasks: [result_for(t, 9.0) for t in tasks[:2]], clients=3, fraction=1.0, quorum=0.5
    )
    assert relaxed.run_round(0).aggregated


def test_rounds_are_persisted_as_metrics_and_checkpoints(make_ctx, tmp_path: Path) -> None:
    coord = coordinator(make_ctx, every_task, tmp=tmp_path, rounds=3, checkpoint_every=2)
    records = coord.run()
    assert [r.round for r in records] == [0, 1, 2]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [0, 1, 2] and all(line["bytes_up"] > 0 for line in lines)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["round-000001", "round-000002"]
    tensors, manifest = load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"))
    assert manifest["round"] == 2 and manifest["method"] == "fedavg" and manifest["seed"] == 7
    assert all(torch.equal(tensors[f"global/{k}"], v) for k, v in coord.strategy.global_state.items())


def test_resume_refuses_a_checkpoint_of_another_method(make_ctx, tmp_path: Path) -> None:
    coordinator(make_ctx, every_task, tmp=tmp_path, rounds=1).run()
    other = Coordinator(
        create_strategy("heterofl", make_ctx()),
        ScriptedTransport(fleet(10), every_task),
        VirtualClock(),
        None,
        RoundPolicy(rounds=3),
        tmp_path,
    )
    with pytest.raises(Exception, match="checkpoint is for method 'fedavg'"):
        other.resume()


class Interrupted(Exception):
    pass


@pytest.mark.parametrize(
    "method, arch, options",
    [
        ("fedavg", "tinycnn", {}),
        ("nefl-wd", "tinycnn", {}),
        # Both keep per-device state between participations (auxiliary models; FedDyn's h_k): a resumed run
        # must get it back from the checkpoint, or its clients restart from scratch.
        ("m-fedepth", "preresnet20", {"budgets": "surplus"}),
        ("depthfl", "tinycnn", {"feddyn_alpha": 0.1}),
    ],
)
def test_resume_after_a_crash_gives_the_same_final_weights_as_an_uninterrupted_run(
    method: str, arch: str, options: dict, tmp_path: Path
) -> None:
    from nestling.simulator.run import run_simulation

    cfg = config_from_dict(
        {
            "run": {"rounds": 3, "seed": 3, "workers": 1, "eval_every": 0},
            "data": {"dataset": "synthetic", "clients": 4, "limit_train": 96, "limit_test": 20},
            "model": {"arch": arch},
            "method": {"name": method, **options},
            "train": {"fraction": 1.0, "local_steps": 2, "batch_size": 16},
        }
    )
    run_simulation(cfg, tmp_path / "straight")

    def crash_after_round_1(record) -> None:
        if record.round == 1:
            raise Interrupted

    with pytest.raises(Interrupted):
        run_simulation(cfg, tmp_path / "resumed", on_round=crash_after_round_1)
    run_simulation(cfg, tmp_path / "resumed", resume=True)

    straight, _ = load_checkpoint(latest_checkpoint(tmp_path / "straight" / "checkpoints"))
    resumed, manifest = load_checkpoint(latest_checkpoint(tmp_path / "resumed" / "checkpoints"))
    assert manifest["round"] == 2 and set(straight) == set(resumed)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    rounds = [
        json.loads(line)["round"]
        for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    ]
    assert rounds == [0, 1, 2]


def test_the_screenings_look_back_is_recorded_and_restored_on_resume(make_ctx, tmp_path: Path) -> None:
    """Each round's median update rms goes to metrics.jsonl; a resumed coordinator looks back on the same
    rounds as the uninterrupted one did."""

    def varied(tasks: list[Task]) -> list[Result]:
        return [result_for(t, value=1.0 + 0.1 * i) for i, t in enumerate(tasks)]

    first = coordinator(make_ctx, varied, tmp=tmp_path, checkpoint_every=1, rounds=3)
    first.run()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(line["update_rms"] > 0 for line in lines)
    assert list(first.admission.recent_rms) == [line["update_rms"] for line in lines]
    (tmp_path / "checkpoints" / "round-000002").rename(tmp_path / "dropped")
    resumed = coordinator(make_ctx, varied, tmp=tmp_path, checkpoint_every=1, rounds=3)
    assert resumed.resume() == 2
    assert list(resumed.admission.recent_rms) == [line["update_rms"] for line in lines[:2]]


def test_packed_results_are_measured_at_the_round_end_and_a_non_finite_update_is_refused_there(
    make_ctx,
) -> None:
    """Packed results (as the wire decoder and the trainer make them) have their updates measured together when
    the round closes: an update whose norm overflows float32 (finite values of 1e30) is refused there, counted
    and named, the device counts as non-finite, and the others are aggregated as without it."""
    from nestling.packed import pack, packing

    def respond(tasks: list[Task]) -> list[Result]:
        assert all(packing(task.weights) is not None for task in tasks)  # `extract` packs every task
        a, b, c = tasks
        results = [result_for(a, 1e30), result_for(b, 2.0), result_for(c, 3.0)]
        for result in results:
            result.weights = pack(result.weights)
        return results

    coord = coordinator(make_ctx, respond, clients=3, fraction=1.0)
    record = coord.run_round(0)
    assert record.accepted == 2 and record.aggregated
    assert {k: v for k, v in record.counters.items() if v} == {"rejected_update_norm": 1}
    assert coord.admission.non_finite == {"dev-00000"}
    assert (
        not coord.admission.refused_tasks
    )  # not refused on arrival (that path records the task for the quorum)
    state = coord.strategy.global_state
    assert all(torch.allclose(v, torch.full_like(v, 2.5)) for v in state.values() if v.is_floating_point())


def test_a_diverging_round_is_undone_and_its_boards_sit_out_their_quarantine(make_ctx) -> None:
    """The loop wires the guard in: the round's aggregation is undone, its boards are not selected in the
    quarantine's rounds, and the coordinator reports what the guard keeps."""
    coord = coordinator(
        make_ctx,
        lambda tasks: [result_for(t, 1e6 if t.round == 0 else 1.0) for t in tasks],
        clients=3,
        fraction=1.0,
        robust=RobustPolicy(quarantine_rounds=1),
    )
    before = {k: v.clone() for k, v in coord.strategy.global_state.items()}
    diverged = coord.run_round(0)
    boards = ["dev-00000", "dev-00001", "dev-00002"]
    assert not diverged.aggregated and diverged.rolled_back == 0 and diverged.quarantined == boards
    assert all(torch.equal(v, before[k]) for k, v in coord.strategy.global_state.items())
    assert coord.quarantine == dict.fromkeys(boards, 2)
    assert coord.quarantine_log == [{"round": 0, "devices": boards, "until_round": 2}]
    assert coord.run_round(1).selected == 0
    assert coord.run_round(2).aggregated and coord.aggregate_seconds > 0.0
    assert coord.totals["rolled_back"] == 1 and coord.totals["rounds_below_quorum"] == 1
