"""Results admitted one by one as they arrive and screened together when the round closes, on a real FedAvg
strategy's tasks answered with real tensors."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

from nestling.messages import Task
from nestling.packed import pack
from nestling.server.refusals import RefusalLog
from nestling.server.result_admission import ResultAdmission, has_non_finite
from nestling.server.screening import RobustPolicy, update_size
from nestling.server.strategies import create_strategy
from tests.server.round_helpers import fleet, result_for


def first_round(
    make_ctx, boards: int = 3, robust: RobustPolicy | None = None
) -> tuple[ResultAdmission, list[Task], dict[str, Task]]:
    """A fresh admission for round 0 of a FedAvg run in which every one of `boards` boards got a task."""
    strategy = create_strategy("fedavg", make_ctx(num_clients=boards))
    admission = ResultAdmission(strategy, robust or RobustPolicy(), RefusalLog(logging.getLogger("test")))
    devices = fleet(boards)
    tasks = list(strategy.assign(0, devices).values())
    admission.new_round(devices, devices, len(tasks))
    return admission, tasks, {t.task_id: t for t in tasks}


def test_each_arrival_gets_a_verdict_and_only_a_refusal_leaves_its_task_open(make_ctx) -> None:
    admission, (a, b, c), by_task = first_round(make_ctx)
    poisoned = result_for(b, 2.0)
    poisoned.weights["head.fc.bias"][0] = float("nan")
    verdicts = [
        admission.admit(0, by_task, result_for(a, 1.0)),
        admission.admit(0, by_task, result_for(a, 1.0)),  # the same task again
        admission.admit(0, by_task, result_for(a, 1.0, round=1)),
        admission.admit(0, by_task, result_for(a, 1.0, round=-1)),
        admission.admit(0, by_task, result_for(a, 1.0, task_id="r0-nobody")),
        admission.admit(0, by_task, result_for(b, 1.0, device_id=c.device_id)),  # another board's task
        admission.admit(0, by_task, poisoned),
        admission.admit(0, by_task, result_for(c, 1.0, num_samples=13)),  # registered 12
        admission.admit(0, by_task, result_for(b, 2.0)),  # corrected: still welcome
    ]
    assert verdicts == [
        None,
        "duplicate",
        "future",
        "stale",
        "unknown_task",
        "unknown_task",
        "rejected_invalid",
        "rejected_num_samples",
        None,
    ]
    assert admission.seen_tasks == {a.task_id, b.task_id}
    assert admission.refused_tasks == {b.task_id, c.task_id}
    assert admission.judged == {a.device_id, b.device_id, c.device_id}
    assert admission.non_finite == {b.device_id}
    assert set(admission.updates) == {a.task_id, b.task_id}  # measured on arrival (unpacked results)


def test_a_result_that_breaks_judging_is_refused_and_counted_never_raised(make_ctx) -> None:
    admission, (a, _, _), by_task = first_round(make_ctx)
    assert admission.admit(0, by_task, result_for(a, round="0")) == "rejected_error"  # str vs int compare
    assert admission.admit(0, by_task, result_for(a, weights=None)) == "rejected_error"
    assert admission.admit(0, by_task, result_for(a, num_samples="5")) == "rejected_error"
    assert admission.refused_tasks == {a.task_id}
    assert admission.admit(0, by_task, result_for(a)) is None  # its task is still open


def test_the_absolute_bound_refuses_on_arrival_and_an_overflowing_update_counts_as_non_finite(
    make_ctx,
) -> None:
    admission, (a, b, c), by_task = first_round(make_ctx, robust=RobustPolicy(max_update_norm=1e6))
    assert admission.admit(0, by_task, result_for(a, 1.0)) is None
    assert admission.admit(0, by_task, result_for(b, 1e5)) == "rejected_update_norm"  # large, finite norm
    assert (
        admission.admit(0, by_task, result_for(c, 1e30)) == "rejected_update_norm"
    )  # norm overflows float32
    assert admission.non_finite == {c.device_id}
    assert set(admission.updates) == {a.task_id} and admission.seconds > 0.0
    assert admission.updates[a.task_id].size.norm == pytest.approx(update_size(a, result_for(a, 1.0)).norm)


def test_packed_results_wait_for_the_round_end_and_are_measured_there(make_ctx) -> None:
    admission, tasks, by_task = first_round(make_ctx)
    results = [result_for(task, value) for task, value in zip(tasks, (1e30, 2.0, 3.0), strict=True)]
    for result in results:
        result.weights = pack(result.weights)
        assert admission.admit(0, by_task, result) is None
    assert not admission.updates  # nothing measured yet
    counters: Counter[str] = Counter()
    kept = admission.screen(0, list(zip(tasks, results, strict=True)), counters)
    assert [r.device_id for _, r in kept] == [tasks[1].device_id, tasks[2].device_id]
    assert counters == Counter({"rejected_update_norm": 1}) and admission.non_finite == {tasks[0].device_id}


def test_wire_refusals_count_for_the_guard_only_when_non_finite_from_a_selected_board(make_ctx) -> None:
    admission, (a, _, _), _ = first_round(make_ctx)
    admission.wire_refused(a.device_id, "oversized")
    admission.wire_refused("dev-99999", "non_finite")  # not selected this round
    assert not admission.judged and not admission.non_finite
    admission.wire_refused(a.device_id, "non_finite")
    assert admission.judged == admission.non_finite == {a.device_id}


def test_the_screen_refuses_an_outlier_and_looks_back_only_on_applied_rounds(make_ctx) -> None:
    admission, tasks, by_task = first_round(make_ctx, boards=4)
    results = [result_for(task, value) for task, value in zip(tasks, (0.5, 0.51, 0.52, 1000.0), strict=True)]
    for result in results:
        assert admission.admit(0, by_task, result) is None
    counters: Counter[str] = Counter()
    kept = admission.screen(0, list(zip(tasks, results, strict=True)), counters)
    assert [r.device_id for _, r in kept] == [t.device_id for t in tasks[:3]]
    assert counters["rejected_update_norm"] == 1
    honest = sorted(update_size(t, r).rms for t, r in zip(tasks[:3], results[:3], strict=True))
    assert admission.round_rms == pytest.approx(honest[1], rel=1e-5)  # the kept updates' median
    assert not admission.recent_rms  # not applied (yet): the next rounds do not look back on it
    admission.round_applied()
    assert list(admission.recent_rms) == [admission.round_rms]
    admission.new_round(fleet(4), fleet(4), 4)  # the round's state goes, the run's stays
    assert not (admission.updates or admission.judged or admission.non_finite or admission.refused_tasks)
    assert admission.seen_tasks == {t.task_id for t in tasks} and len(admission.recent_rms) == 1


def test_a_resume_restores_the_look_back_from_aggregated_rounds_with_a_finite_rms(make_ctx) -> None:
    admission, _, _ = first_round(make_ctx)
    admission.restore(
        [
            {"round": 0, "aggregated": True, "update_rms": 0.5},
            {"round": 1, "aggregated": False, "update_rms": 9.0},
            {"round": 2, "aggregated": True},
            {"round": 3, "aggregated": True, "update_rms": float("nan")},
            {"round": 4, "aggregated": True, "update_rms": "0.7"},
            {"round": 5, "aggregated": True, "update_rms": 2},
        ]
    )
    assert list(admission.recent_rms) == [0.5, 2.0]


def test_a_resume_restores_each_cohorts_recent_medians_as_the_cohort_screen_kept_them(make_ctx) -> None:
    """The cohort screen judges a submodel only when its recent round medians agree (server/update_cohort.py):
    a resumed run must look back on the same medians as the uninterrupted one, read from metrics.jsonl."""
    from nestling.server.update_cohort import CONSENSUS_ROUNDS

    admission, _, _ = first_round(make_ctx)
    records = [
        {"round": r, "aggregated": True, "cohort_screen": {"medians": {"a": 0.1 * r}}} for r in range(7)
    ]
    records[3]["cohort_screen"]["medians"]["b"] = 0.6
    records[4]["cohort_screen"] = {
        "judged": ["d0"],
        "refused": [],
        "medians": {"a": "0.4", "b": float("nan")},
    }
    records[5]["cohort_screen"] = {"medians": ["not", "a", "mapping"]}
    admission.restore(records)
    # a's medians 0.0, 0.1, 0.2, 0.3 and 0.6 (round 4's string and round 5's list are not medians): the last
    # CONSENSUS_ROUNDS - 1 kept, oldest first; b's NaN left out
    assert CONSENSUS_ROUNDS == 5
    assert admission.consensus["a"] == pytest.approx([0.1, 0.2, 0.3, 0.6])
    assert admission.consensus["b"] == [0.6]


def test_has_non_finite_reads_float_tensors_and_never_raises() -> None:
    assert has_non_finite({"w": torch.tensor([1.0, float("inf")]), "n": torch.tensor([1])})
    assert not has_non_finite({"w": torch.ones(3), "n": torch.tensor([7])})
    assert not has_non_finite({"w": "not a tensor"})  # type: ignore[dict-item]
