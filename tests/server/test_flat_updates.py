"""Flat updates: the stand-alone vector and the workspace's reused rows hold the same numbers (packed results or
not), rows come back round after round, a refused result's row is lent again, and the direction screen reads the
workspace's matrix exactly as it reads separate vectors."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from nestling.errors import SpecError
from nestling.messages import Result, Task
from nestling.packed import pack
from nestling.server.flat_updates import FlatUpdate, UpdateWorkspace, flat_update
from nestling.server.running_statistics import measure
from nestling.server.screening import GlobalLayout, direction_cosines

SHAPES = {"conv.weight": (8, 4, 3, 3), "conv.bias": (8,), "bn.running_mean": (8,), "fc.weight": (10, 8)}


def _task(width: int = 8, seed: int = 0) -> Task:
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {
        key: torch.randn((width, *shape[1:]) if key != "fc.weight" else (10, width), generator=generator)
        for key, shape in SHAPES.items()
    }
    weights["bn.num_batches_tracked"] = torch.tensor(5)
    return Task(round=0, device_id="d", spec={}, weights=weights, procedure="sgd", task_id="t")


def _result(task: Task, seed: int, scale: float = 0.1, sign: float = 1.0) -> Result:
    generator = torch.Generator().manual_seed(100 + seed)
    trend = {k: torch.ones_like(v) for k, v in task.weights.items() if v.is_floating_point()}
    weights = {
        k: v + sign * scale * (trend[k] + 0.5 * torch.randn(v.shape, generator=generator))
        if v.is_floating_point()
        else v + 1
        for k, v in task.weights.items()
    }
    return Result(
        round=0, device_id=f"d{seed}", task_id=f"t{seed}", spec_id="s", num_samples=1, weights=weights
    )


def test_the_workspace_row_holds_what_the_stand_alone_update_holds() -> None:
    task = _task()
    result = _result(task, 0)
    before = {k: v.clone() for k, v in result.weights.items()}
    workspace = UpdateWorkspace()
    workspace.new_round(4)
    row, alone = workspace.flat_update(task, result), flat_update(task, result)
    assert torch.equal(row.vector, alone.vector) and row.size == alone.size
    assert row.keys == alone.keys and "bn.num_batches_tracked" not in row.keys  # integer buffers are skipped
    assert "bn.running_mean" not in row.keys and row.statistics == alone.statistics  # statistics ride beside
    assert row.size.elements == sum(
        math.prod(v.shape)
        for k, v in task.weights.items()
        if v.is_floating_point() and k != "bn.running_mean"
    )
    assert all(torch.equal(result.weights[k], before[k]) for k in before)  # the upload is never written


def test_rows_are_reused_across_rounds_and_a_released_row_is_lent_again() -> None:
    task = _task()
    workspace = UpdateWorkspace()
    workspace.new_round(3)
    first = [workspace.flat_update(task, _result(task, i)) for i in range(3)]
    storage = {u.vector.data_ptr() for u in first}
    workspace.release(first[1])  # refused on arrival: the next result takes its row
    again = workspace.flat_update(task, _result(task, 7))
    assert again.vector is first[1].vector and torch.equal(
        again.vector, flat_update(task, _result(task, 7)).vector
    )
    workspace.new_round(3)
    second = [workspace.flat_update(task, _result(task, i)) for i in range(3)]
    assert {u.vector.data_ptr() for u in second} == storage  # no new buffers in a steady round


def test_more_results_than_expected_get_rows_of_their_own_and_the_matrix_grows_next_round() -> None:
    task = _task()
    workspace = UpdateWorkspace()
    workspace.new_round(2)
    updates = [workspace.flat_update(task, _result(task, i)) for i in range(3)]
    assert workspace.stacked(updates) is None  # one row is outside the matrix: the screen reads vectors
    assert torch.equal(updates[2].vector, flat_update(task, _result(task, 2)).vector)
    workspace.new_round(2)
    updates = [workspace.flat_update(task, _result(task, i)) for i in range(3)]
    stacked = workspace.stacked(updates)
    assert stacked is not None and stacked[1] == [0, 1, 2] and stacked[0].shape[0] == 3


def test_a_layout_unused_for_a_round_is_dropped() -> None:
    wide, narrow = _task(8), _task(4)
    workspace = UpdateWorkspace()
    workspace.new_round(1)
    workspace.flat_update(wide, _result(wide, 0))
    workspace.new_round(1)
    workspace.flat_update(narrow, _result(narrow, 0))  # only the narrow layout this round
    workspace.new_round(1)
    assert [shapes[0][0] for plan in workspace._plans.values() for shapes in plan.pools] == [4]


def test_a_task_whose_shapes_differ_from_the_result_is_named() -> None:
    task = _task()
    result = _result(task, 0)
    wrong = Task(**{**task.__dict__, "weights": {**task.weights, "conv.bias": torch.zeros(5)}})
    workspace = UpdateWorkspace()
    workspace.new_round(1)
    with pytest.raises(SpecError, match="task's shapes"):
        workspace.flat_update(wrong, result)
    with pytest.raises(SpecError, match="task's shapes"):
        flat_update(wrong, result)


@pytest.mark.parametrize("refuse", [None, 1])
def test_direction_cosines_from_the_matrix_equal_those_from_vectors(refuse: int | None) -> None:
    task = _task()
    layout = GlobalLayout({k: tuple(v.shape) for k, v in task.weights.items() if v.is_floating_point()})
    results = [_result(task, i, sign=-1.0 if i == 4 else 1.0) for i in range(6)]
    workspace = UpdateWorkspace()
    workspace.new_round(len(results))
    rows = [workspace.flat_update(task, r) for r in results]
    alone = [flat_update(task, r) for r in results]
    if refuse is not None:  # an update refused by the norm screen leaves a gap in the matrix
        del rows[refuse], alone[refuse]
    assert workspace.stacked(rows) is not None
    got, want = direction_cosines(rows, layout, workspace), direction_cosines(alone, layout)
    assert all(g is not None and w is not None and abs(g - w) < 1e-5 for g, w in zip(got, want, strict=True))
    assert min(got, key=lambda c: c or 0.0) == got[3 if refuse == 1 else 4]  # the sign flip points away


def _with_statistics(mean: float, var: float, weight_step: float) -> tuple[Task, Result]:
    task = Task(
        round=0,
        device_id="d",
        spec={},
        weights={
            "conv.weight": torch.ones(4, 2),
            "bn.running_mean": torch.zeros(4),
            "bn.running_var": torch.ones(4),
            "bn.num_batches_tracked": torch.tensor(0),
            "bn.running_var_w1": torch.ones(2),
        },
        procedure="sgd",
        task_id="t",
    )
    weights = {
        "conv.weight": torch.ones(4, 2) + weight_step,
        "bn.running_mean": torch.full((4,), mean),
        "bn.running_var": torch.full((4,), var),
        "bn.num_batches_tracked": torch.tensor(7),
        "bn.running_var_w1": torch.full((2,), var),
    }
    return task, Result(round=0, device_id="d", task_id="t", spec_id="s", num_samples=1, weights=weights)


def test_running_statistics_stay_out_of_the_update_and_travel_beside_it() -> None:
    """Statistics leaving their initial values (a submodel's first update) do not count in the update's norm;
    the uploaded tensors ride beside it, the same from the workspace as stand-alone."""
    task, result = _with_statistics(mean=0.5, var=9.0, weight_step=0.01)
    workspace = UpdateWorkspace()
    workspace.new_round(1)
    for update in (flat_update(task, result), workspace.flat_update(task, result)):
        assert update.keys == ("conv.weight",)
        assert update.size.norm == pytest.approx(0.01 * math.sqrt(8))
        assert update.statistics.keys == ("bn.running_mean", "bn.running_var", "bn.running_var_w1")
        assert all(
            t is result.weights[k]
            for k, t in zip(update.statistics.keys, update.statistics.tensors, strict=True)
        )


def _packed_pair(seed: int, scale: float = 0.1) -> tuple[Task, Result]:
    task = _task()
    result = _result(task, seed, scale)
    return replace(task, weights=pack(task.weights)), replace(result, weights=pack(result.weights))


def _by_key(update: FlatUpdate) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for key, shape in zip(update.keys, update.shapes, strict=True):
        count = math.prod(shape)
        out[key] = update.vector[offset : offset + count].view(shape)
        offset += count
    return out


def test_a_packed_result_gives_the_same_update_as_the_per_tensor_path() -> None:
    """Packed (one subtraction of two buffers, keys in the buffer's order) or not: the same update per key, the
    same norm to float32 rounding, the same statistics."""
    task, result = _packed_pair(0)
    plain_task = replace(task, weights=dict(task.weights))
    plain_result = replace(result, weights=dict(result.weights))
    packed, plain = flat_update(task, result), flat_update(plain_task, plain_result)
    assert packed.statistics.flat is not None and plain.statistics.flat is None  # the two paths were taken
    assert set(packed.keys) == set(plain.keys)
    assert all(torch.equal(_by_key(packed)[k], _by_key(plain)[k]) for k in plain.keys)
    assert packed.size.norm == pytest.approx(plain.size.norm, rel=1e-6)
    assert packed.size.elements == plain.size.elements
    assert measure([packed.statistics])[0] == measure([plain.statistics])[0]


def test_a_round_of_packed_results_is_measured_together_as_one_by_one() -> None:
    """`flat_updates` writes a round's packed updates with one stack, one subtraction and one norm per layout:
    the same rows as `flat_update` one at a time, also when some rows were given back (scattered) and when
    results of other layouts and unpacked ones are mixed in."""
    pairs = [_packed_pair(seed) for seed in range(5)]
    alone = [flat_update(task, result) for task, result in pairs]
    workspace = UpdateWorkspace()
    workspace.new_round(5)
    together = workspace.flat_updates(pairs)
    for one, other in zip(together, alone, strict=True):
        assert torch.equal(one.vector, other.vector) and one.keys == other.keys
        assert one.size.norm == pytest.approx(other.size.norm, rel=1e-6)
    stacked = workspace.stacked(together)
    assert stacked is not None and stacked[1] == [0, 1, 2, 3, 4]  # consecutive rows of one matrix
    workspace.new_round(5)
    first = workspace.flat_updates(pairs[:3])
    workspace.release(first[1])  # row 1 is free again: the next ones are not consecutive
    plain_task = _task()
    mixed = [pairs[3], (plain_task, _result(plain_task, 9)), pairs[4]]
    later = workspace.flat_updates(mixed)
    assert torch.equal(later[0].vector, alone[3].vector) and torch.equal(later[2].vector, alone[4].vector)
    assert torch.equal(later[1].vector, flat_update(*mixed[1]).vector)


def test_a_packed_result_whose_mapping_was_changed_is_read_per_tensor() -> None:
    """The packing is dropped on any change to the mapping, so the screen never reads a stale buffer."""
    task, result = _packed_pair(0)
    result.weights["fc.weight"] = result.weights["fc.weight"] + 100.0  # a changed tensor, not in the buffer
    workspace = UpdateWorkspace()
    workspace.new_round(1)
    assert not workspace.packed(task, result)
    update = workspace.flat_update(task, result)
    assert float(_by_key(update)["fc.weight"].mean()) > 99.0
