"""What a run leaves on disk and how it continues: evaluation rounds scored by a real Evaluator, metrics lines,
checkpoints of a real strategy on the policy's rounds, and the resume from the newest complete one."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from nestling.server.checkpoint import latest_checkpoint, load_checkpoint
from nestling.server.evaluation import Evaluator
from nestling.server.rounds import RoundPolicy, RoundRecord
from nestling.server.run_recorder import RunRecorder
from nestling.server.strategies import Strategy, create_strategy


class DeviceStores:
    """Side state as the simulator keeps it: tensors outside the strategy a checkpoint carries."""

    name = "stores"

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None) -> None:
        self.tensors = dict(tensors or {})

    def snapshot(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)


def record_of(round_index: int, **changes) -> RoundRecord:
    values = {
        "round": round_index,
        "wall_seconds": 0.5,
        "collect_seconds": 0.25,
        "virtual_time": float(round_index),
        "selected": 3,
        "accepted": 3,
        "aggregated": True,
        "bytes_down": 100,
        "bytes_up": 100,
    }
    values.update(changes)
    return RoundRecord(**values)


def recorded_run(
    strategy: Strategy, out: Path | None, side: DeviceStores | None = None, **policy
) -> RunRecorder:
    """Three rounds recorded, each counting one late result; the strategy's state marks the round."""
    recorder = RunRecorder(strategy, None, RoundPolicy(**{"rounds": 3, "seed": 5, **policy}), out, side)
    for round_index in range(3):
        for value in strategy.global_state.values():
            if value.is_floating_point():
                value.fill_(float(round_index))
        if side is not None:
            side.tensors = {"dev-00000/aux": torch.full((2,), float(round_index))}
        record = record_of(round_index, update_rms=0.1 * (round_index + 1), counters={"late": 1})
        recorder.record(round_index, record, Counter(late=1))
    return recorder


@pytest.fixture
def strategy(make_ctx) -> Strategy:
    return create_strategy("fedavg", make_ctx(num_clients=3))


def test_evaluation_rounds_are_every_nth_and_the_last(strategy: Strategy) -> None:
    def schedule(every: int) -> list[int]:
        recorder = RunRecorder(strategy, None, RoundPolicy(rounds=7, eval_every=every))
        return [r for r in range(7) if recorder.is_eval_round(r)]

    assert schedule(1) == list(range(7))
    assert schedule(3) == [2, 5, 6]
    assert schedule(0) == [6]


def test_an_evaluation_round_is_scored_by_the_evaluator_and_added_to_its_record(strategy: Strategy) -> None:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 3, 8, 8, generator=generator), torch.randint(0, 4, (12,), generator=generator)
    recorder = RunRecorder(strategy, Evaluator(x, y), RoundPolicy(rounds=4, eval_every=2))
    skipped, scored = record_of(0), record_of(1)
    recorder.evaluate(0, skipped)
    recorder.evaluate(1, scored)
    assert skipped.submodels == [] and len(recorder.last_eval) == len(strategy.eval_targets()) == 1
    assert scored.submodels == [
        {
            "name": e.name,
            "spec_id": e.spec_id,
            "accuracy": e.accuracy,
            "loss": e.loss,
            "parameters": e.parameters,
            "macs": e.macs,
        }
        for e in recorder.last_eval
    ]
    assert 0.0 <= scored.submodels[0]["accuracy"] <= 1.0 and scored.submodels[0]["macs"] > 0
    without = RunRecorder(strategy, None, RoundPolicy(rounds=1))
    without.evaluate(0, record := record_of(0))
    assert without.last_eval == [] and record.submodels == []


def test_without_an_output_folder_only_the_totals_are_kept(strategy: Strategy, tmp_path: Path) -> None:
    recorder = recorded_run(strategy, None)
    assert recorder.totals == Counter(late=3)
    with pytest.raises(Exception, match="--resume needs an output directory"):
        recorder.resume()


def test_rounds_are_recorded_as_metrics_lines_and_checkpointed_when_due(
    strategy: Strategy, tmp_path: Path
) -> None:
    side = DeviceStores()
    recorder = recorded_run(strategy, tmp_path, side, checkpoint_every=2)
    recorder.record(4, record_of(4, plans={"dev-00000": {"spec": "w50"}}), Counter())
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [0, 1, 2, 4]
    assert "plans" not in lines[0] and "replans" not in lines[0] and lines[0]["update_rms"] == 0.1
    assert lines[3]["plans"] == {"dev-00000": {"spec": "w50"}} and "update_rms" not in lines[3]
    assert lines[0]["counters"] == {"late": 1}
    # every 2nd round and the policy's last (round 2 of 3); the 5th (index 4) is not due
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["round-000001", "round-000002"]
    tensors, manifest = load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"))
    assert manifest["round"] == 2 and manifest["seed"] == 5 and manifest["totals"] == {"late": 3}
    assert all(torch.equal(tensors[f"global/{k}"], v) for k, v in strategy.global_state.items())


def test_a_resume_loads_the_newest_checkpoint_and_drops_the_later_rounds_metrics(
    strategy: Strategy, make_ctx, tmp_path: Path
) -> None:
    recorded_run(strategy, tmp_path, DeviceStores(), checkpoint_every=2)
    (tmp_path / "checkpoints" / "round-000002").rename(
        tmp_path / "lost"
    )  # the crash came before it was whole
    fresh, side = create_strategy("fedavg", make_ctx(num_clients=3)), DeviceStores()
    recorder = RunRecorder(fresh, None, RoundPolicy(rounds=3), tmp_path, side)
    start, kept = recorder.resume()
    assert start == 2 and [line["round"] for line in kept] == [0, 1] and kept[1]["update_rms"] == 0.2
    assert [json.loads(line)["round"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        0,
        1,
    ]
    floats = [v for v in fresh.global_state.values() if v.is_floating_point()]
    assert all(torch.equal(v, torch.full_like(v, 1.0)) for v in floats)  # round 1's state
    assert torch.equal(side.tensors["dev-00000/aux"], torch.full((2,), 1.0))
    assert recorder.totals == Counter(late=2)


def test_a_resume_names_what_is_missing_or_does_not_match(
    strategy: Strategy, make_ctx, tmp_path: Path
) -> None:
    with pytest.raises(Exception, match="no complete checkpoint under"):
        RunRecorder(strategy, None, RoundPolicy(rounds=3), tmp_path).resume()
    recorded_run(strategy, tmp_path)
    other = create_strategy("heterofl", make_ctx(num_clients=3))
    with pytest.raises(Exception, match="checkpoint is for method 'fedavg', not 'heterofl'"):
        RunRecorder(other, None, RoundPolicy(rounds=3), tmp_path).resume()
