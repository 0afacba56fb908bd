"""Boards the cohort screen keeps refusing are set aside (server/strikes.py): the rule, and through real runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nestling.server.checkpoint import latest_checkpoint, load_checkpoint
from nestling.server.strikes import StrikeRecord
from nestling.simulator.run import run_simulation


def test_two_refusals_in_three_judged_rounds_set_a_board_aside_longer_each_time() -> None:
    record = StrikeRecord(rounds=5)
    everyone = ["a", "b", "c"]
    assert record.judge(0, everyone, {"a"}) == {}
    assert record.judge(1, everyone, set()) == {}
    assert record.judge(2, everyone, {"a"}) == {"a": 8}  # refused in rounds 0 and 2 of its last three
    assert record.judge(9, everyone, {"a"}) == {}  # its record started over when it was set aside
    assert record.judge(10, everyone, {"a"}) == {"a": 21}  # the second time: twice as long
    # rounds without a consensus do not count: a board is judged only where its cohort agreed
    assert record.judge(11, ["b", "c"], {"b"}) == {} and record.judge(12, ["c"], set()) == {}
    assert record.judge(13, ["b"], {"b"}) == {"b": 19}


def test_probation_ends_after_three_judged_rounds_in_a_row_without_a_refusal() -> None:
    record = StrikeRecord(rounds=5)
    record.judge(0, ["a"], {"a"})
    assert record.judge(1, ["a"], {"a"}) == {"a": 7} and record.on_probation("a")
    record.judge(7, ["a"], set())
    record.judge(8, ["a"], {"a"})  # a refusal starts the count again
    record.judge(9, ["a"], set())
    record.judge(10, [], set())  # a round that could not judge it counts for nothing
    record.judge(11, ["a"], set())
    assert record.on_probation("a")
    record.judge(12, ["a"], set())
    assert not record.on_probation("a") and not record.on_probation("b")
    assert record.judge(13, ["a"], {"a"}) == {} and record.judge(14, ["a"], {"a"}) == {"a": 25}  # doubled


def test_an_honest_record_and_strike_rounds_zero_never_set_anyone_aside() -> None:
    honest, off = StrikeRecord(rounds=5), StrikeRecord(rounds=0)
    for round_index in range(30):  # one refusal in every third round is never two in three
        refused = {"a"} if round_index % 3 == 0 else set()
        assert honest.judge(round_index, ["a", "b"], refused) == {}
        assert off.judge(round_index, ["a"], {"a"}) == {}


def _digits(rounds: int, **run: Any):
    from nestling.config import config_from_dict

    return config_from_dict(
        {
            "run": {"rounds": rounds, "seed": 0, "workers": 1, "eval_every": 0, "quorum": 0.6, **run},
            "data": {"dataset": "digits", "clients": 6, "limit_train": 400, "limit_test": 50},
            "model": {"arch": "tinycnn"},
            "method": {"name": "fedavg"},
            "train": {"fraction": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
        }
    )


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]


def _final(out: Path) -> dict[str, torch.Tensor]:
    path = latest_checkpoint(out / "checkpoints")
    assert path is not None
    return load_checkpoint(path)[0]


def test_a_sign_flipping_board_is_set_aside_after_two_refusals_and_a_resume_keeps_it_aside(
    tmp_path: Path,
) -> None:
    from benchmarks.robustness import ATTACKS

    flip = ATTACKS["sign_flipped"].tamper
    run_simulation(_digits(5), tmp_path / "straight", tamper=flip)
    records = _records(tmp_path / "straight")
    assert [r["counters"].get("rejected_update_cohort", 0) for r in records] == [1, 1, 0, 0, 0]
    assert records[1]["set_aside"] == {"dev-00000": 7} and records[1]["counters"]["set_aside_by_strikes"] == 1
    assert records[0]["cohort_screen"]["refused"] == ["dev-00000"]
    assert len(records[0]["cohort_screen"]["judged"]) == 6
    # each round's median cosine per submodel cohort, which later rounds' consensus (and a resume) reads back
    assert all(len(r["cohort_screen"]["medians"]) == 1 for r in records)
    assert next(iter(records[0]["cohort_screen"]["medians"].values())) > 0.4  # the round that judged
    assert [r["selected"] for r in records] == [6, 6, 5, 5, 5]  # not selected while aside

    class Stop(Exception):
        pass

    def stop_after_round_2(record: Any) -> None:
        if record.round == 2:
            raise Stop

    with pytest.raises(Stop):
        run_simulation(
            _digits(5, checkpoint_every=1), tmp_path / "resumed", tamper=flip, on_round=stop_after_round_2
        )
    run_simulation(_digits(5, checkpoint_every=1), tmp_path / "resumed", tamper=flip, resume=True)
    assert [r["selected"] for r in _records(tmp_path / "resumed")] == [6, 6, 5, 5, 5]
    straight, resumed = _final(tmp_path / "straight"), _final(tmp_path / "resumed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_an_honest_run_sets_nobody_aside(tmp_path: Path) -> None:
    run_simulation(_digits(4), tmp_path / "honest")
    records = _records(tmp_path / "honest")
    assert all("set_aside" not in r and not r["quarantined"] for r in records)
    assert all(not r.get("cohort_screen", {}).get("refused") for r in records)


def test_a_board_on_probation_is_not_taken_in_a_round_too_small_to_judge_it() -> None:
    import logging
    from collections import Counter

    from nestling.messages import Result, Task
    from nestling.server.refusals import RefusalLog
    from nestling.server.round_screen import RoundScreen
    from nestling.server.screening import GlobalLayout, RobustPolicy, UpdateWorkspace

    pairs, updates, workspace = [], {}, UpdateWorkspace()
    workspace.new_round(3)
    for i in range(3):  # three boards, fewer than a cohort needs to be judged
        sent = {"w": torch.zeros(8)}
        task = Task(round=4, device_id=f"d{i}", spec={}, weights=sent, procedure="train", task_id=f"t{i}")
        trained = {"w": torch.full((8,), 0.1 * (i + 1))}
        result = Result(
            round=4, device_id=f"d{i}", task_id=f"t{i}", spec_id="s", num_samples=10, weights=trained
        )
        updates[f"t{i}"] = workspace.flat_update(task, result)
        pairs.append((task, result))
    strikes = StrikeRecord(rounds=5)
    strikes.judge(0, ["d1"], {"d1"})
    strikes.judge(1, ["d1"], {"d1"})  # set aside, then back on probation
    screen = RoundScreen(
        RobustPolicy(),
        RefusalLog(logging.getLogger("test")),
        workspace,
        updates,
        set(),
        None,
        lambda: GlobalLayout({"w": (8,)}),
        [10, 10, 10],
        strikes,
    )
    counters: Counter[str] = Counter()
    kept, _ = screen.run(4, pairs, counters)
    assert [r.device_id for _, r in kept] == ["d0", "d2"] and counters["rejected_update_cohort"] == 1
