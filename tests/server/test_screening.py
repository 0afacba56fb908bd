"""Update screening and clipping on their own: sizes, the round-relative outlier rule, the absolute bound."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nestling.errors import ConfigError
from nestling.messages import Result, Task
from nestling.server.screening import (
    FlatUpdate,
    GlobalLayout,
    RobustPolicy,
    UpdateSize,
    absolute_reason,
    clip_update,
    direction_cosines,
    direction_outliers,
    outliers,
    screen_norms,
    soft_bounds,
    update_size,
)


def exchange(sent: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> tuple[Task, Result]:
    """A task carrying `sent` and the result that answers it with `trained`."""
    task = Task(round=0, device_id="d", spec={}, weights=sent, procedure="sgd", task_id="t")
    result = Result(round=0, device_id="d", task_id="t", spec_id="s", num_samples=1, weights=trained)
    return task, result


def pair(update: float, n: int = 4) -> tuple[Task, Result]:
    return exchange(
        {"w": torch.ones(n), "steps": torch.tensor(3)},
        {"w": torch.ones(n) + update, "steps": torch.tensor(9)},
    )


def test_update_size_skips_integer_buffers_and_overflow_is_non_finite() -> None:
    assert update_size(*pair(0.5)) == UpdateSize(1.0, 4)  # sqrt(4 * 0.25)
    huge = update_size(*pair(3.0e38))
    assert huge.norm == math.inf and absolute_reason(huge, RobustPolicy()) == "non-finite update"


def test_outliers_are_judged_against_the_others_upper_quartile_rms() -> None:
    sizes = [UpdateSize(1.0, 100), UpdateSize(1.2, 100), UpdateSize(0.1, 1), UpdateSize(100.0, 100)]
    refused = outliers(sizes, RobustPolicy())
    assert list(refused) == [3]  # the small submodel's update (rms 0.1) is not an outlier
    assert "upper quartile" in refused[3]
    assert list(outliers([UpdateSize(1.0, 10), UpdateSize(50.0, 10)], RobustPolicy())) == [
        1
    ]  # two boards suffice


def test_absolute_bound_and_clipping() -> None:
    policy = RobustPolicy(max_update_norm=0.5)
    task, result = pair(0.5)
    assert "above the bound" in absolute_reason(update_size(task, result), policy)
    clipped = clip_update(task, result, update_size(task, result).norm, 0.5)
    assert update_size(task, clipped).norm == pytest.approx(0.5)
    assert torch.equal(clipped.weights["steps"], result.weights["steps"])
    assert clip_update(task, result, 1.0, 2.0) is result


def test_bad_settings_are_named() -> None:
    with pytest.raises(ConfigError, match="aggregation"):
        RobustPolicy(aggregation="mode")
    with pytest.raises(ConfigError, match="update_norm_factor"):
        RobustPolicy(update_norm_factor=1.0)


def _reference_cosines(updates: list[FlatUpdate], layout: GlobalLayout) -> list[float]:
    """The definition, element by element: cosine of u_i with the mean of the others that touch each element."""
    total = torch.zeros(layout.size, dtype=torch.float64)
    count = torch.zeros(layout.size, dtype=torch.float64)
    placed = []
    for u in updates:
        where = layout.positions(u)
        assert where is not None
        total.index_add_(0, where, u.vector.double())
        count.index_add_(0, where, torch.ones(where.numel(), dtype=torch.float64))
        placed.append((u.vector.double(), where))
    out = []
    for vector, where in placed:
        others = count[where] - 1
        keep = others > 0
        mean = (total[where] - vector)[keep] / others[keep]
        out.append(float(torch.nn.functional.cosine_similarity(vector[keep], mean, dim=0)))
    return out


def _nested_update(width: int, seed: int, flip: bool = False) -> FlatUpdate:
    generator = torch.Generator().manual_seed(seed)
    trend = {"conv": torch.ones(8, 4), "bias": torch.ones(8)}
    weights = {k: v[:width] if k == "bias" else v[:width, : width // 2] for k, v in trend.items()}
    result = {
        k: (-1 if flip else 1) * v + 0.3 * torch.randn(v.shape, generator=generator)
        for k, v in weights.items()
    }
    keys = ("conv", "bias")
    vector = torch.cat([result[k].reshape(-1) for k in keys])
    shapes = tuple(tuple(result[k].shape) for k in keys)
    return FlatUpdate(keys, shapes, vector, UpdateSize(float(vector.norm()), vector.numel()))


def test_direction_cosines_equal_the_definition_for_equal_and_nested_submodels() -> None:
    layout = GlobalLayout({"conv": (8, 4), "bias": (8,)})
    same = [_nested_update(8, seed) for seed in range(4)]
    nested = [_nested_update(w, seed) for seed, w in enumerate((8, 8, 6, 4, 4, 2))]
    for updates in (same, nested):
        got, want = direction_cosines(updates, layout), _reference_cosines(updates, layout)
        assert all(g is not None and abs(g - w) < 1e-5 for g, w in zip(got, want, strict=True)), (got, want)


def test_a_sign_flipped_update_is_refused_and_honest_ones_are_not() -> None:
    layout = GlobalLayout({"conv": (8, 4), "bias": (8,)})
    updates = [_nested_update(w, seed) for seed, w in enumerate((8, 8, 6, 4, 4, 2))]
    updates.append(_nested_update(6, 99, flip=True))
    refused = direction_outliers(direction_cosines(updates, layout), RobustPolicy(min_update_cosine=0.0))
    assert list(refused) == [6] and "below" in refused[6]
    assert direction_outliers(direction_cosines(updates, layout), RobustPolicy()) == {}  # opt-in (issue 29)


def test_direction_needs_three_updates_a_consensus_and_refuses_only_a_minority() -> None:
    policy = RobustPolicy(min_update_cosine=0.0)
    assert direction_outliers([0.9, -0.9], policy) == {}  # two updates: neither can be told from the attacker
    assert direction_outliers([0.9, 0.85, -0.9], policy) == {
        2: direction_outliers([0.9, 0.85, -0.9], policy)[2]
    }
    assert direction_outliers([0.1, -0.2, 0.05, -0.6, 0.0], policy) == {}  # no consensus (median below 0.2)
    assert direction_outliers([0.9, -0.9, -0.8, -0.85], policy) == {}  # a majority against: nothing to defend
    assert direction_outliers([0.9, 0.8, 0.85, -0.9], RobustPolicy(min_update_cosine=-1.0)) == {}  # off
    assert direction_outliers([0.9, 0.5, 0.95, 0.4, 0.9], policy) == {}  # low but positive: honest non-IID


def test_flattening_never_writes_into_the_upload_and_compares_mixed_precision_in_float32() -> None:
    from nestling.server.screening import flat_update

    task, result = pair(0.5)  # one floating tensor: flattening it alone is a view of the upload itself
    before = result.weights["w"].clone()
    update = flat_update(task, result)
    assert torch.equal(result.weights["w"], before) and torch.equal(task.weights["w"], torch.ones(4))
    assert update.vector.dtype == torch.float32 and update.size.norm == pytest.approx(1.0)
    half = Result(
        **{**result.__dict__, "weights": {"w": before.to(torch.bfloat16), "steps": torch.tensor(9)}}
    )
    assert flat_update(task, half).vector.dtype == torch.float32
    assert flat_update(task, half).size.norm == pytest.approx(1.0)
    assert update.shapes == ((4,),)


def test_largest_magnitude_sees_negative_weights_and_non_finite_ones() -> None:
    from nestling.server.screening import largest_magnitude

    state = {"a": torch.tensor([0.5, -3.0]), "b": torch.tensor([[2.0]]), "steps": torch.tensor(10**6)}
    assert largest_magnitude(state) == 3.0  # integer buffers are not weights
    assert largest_magnitude({"a": torch.tensor([1.0, float("nan")])}) == math.inf
    assert largest_magnitude({**state, "b": torch.tensor([-float("inf")])}) == math.inf
    assert largest_magnitude({"steps": torch.tensor(3)}) == 0.0
    assert largest_magnitude({"a": torch.zeros(0), "b": torch.zeros(0, 4)}) == 0.0  # no weights held at all


def test_clipping_leaves_running_statistics_as_uploaded() -> None:
    task, result = exchange(
        {"w": torch.zeros(4), "bn.running_var": torch.ones(4)},
        {"w": torch.full((4,), 2.0), "bn.running_var": torch.full((4,), 7.0)},
    )
    size = update_size(task, result)
    assert size.norm == pytest.approx(4.0)
    clipped = clip_update(task, result, size.norm, 1.0)
    assert torch.allclose(clipped.weights["w"], torch.full((4,), 0.5))
    assert torch.equal(clipped.weights["bn.running_var"], torch.full((4,), 7.0))


def test_late_in_a_run_an_update_as_large_as_recent_rounds_is_clipped_not_refused() -> None:
    """Figures of the planning benchmark's round 8 (ResNet-20 NeFL on digits): the boards' updates had shrunk to
    ~0.0006 rms, a board re-planned onto data new to its submodel sent 0.0147, the last rounds' largest median was
    0.0075. Measured against the round alone it is refused; against the recent rounds too it is kept, clipped
    to 10x the round's median. An update 1000x an honest one is refused either way."""
    honest = [UpdateSize(0.0006 * 100, 10_000) for _ in range(5)]  # rms 0.0006
    newcomer = UpdateSize(0.0147 * 100, 10_000)
    policy = RobustPolicy()
    assert list(outliers([*honest, newcomer], policy)) == [5]
    assert outliers([*honest, newcomer], policy, recent=0.0075) == {}
    assert soft_bounds([*honest, newcomer], policy) == {5: pytest.approx(10 * 0.0006 * 100)}
    attacker = UpdateSize(0.6 * 100, 10_000)  # x1000
    refused = outliers([*honest, attacker], policy, recent=0.0075)
    assert list(refused) == [5] and "and the last rounds' largest 0.0075" in refused[5]
    assert soft_bounds(honest, policy) == {}  # an honest round is left as it is


def test_each_updates_reference_is_the_upper_quartile_of_the_others_finite_updates() -> None:
    import numpy as np

    from nestling.server.screening import _others_reference

    rounds = [[0.3, 0.1, 0.2, 0.5], [1.0, math.inf, 2.0], [math.nan, 4.0], [7.0], [0.2, 0.2, 0.9]]
    for rms in rounds:
        finite = [r for r in rms if math.isfinite(r)]
        expected = []
        for mine in rms:
            others = list(finite)
            if math.isfinite(mine):
                others.remove(mine)
            expected.append(float(np.quantile(others, 0.75)) if others else None)
        assert _others_reference(rms) == pytest.approx(expected)


def test_a_bimodal_honest_round_is_neither_refused_nor_clipped() -> None:
    """DynamicFL's capacity tiers, measured: in one round of four boards two sent 3.2e-5 and 3.7e-5 rms, two
    1.07e-3 and 2.58e-3. Against the others' median the larger two were clipped (an honest run changed); against
    their upper quartile nothing happens, and a x100 update is still refused."""
    sizes = [UpdateSize(r * 72.6, 5268) for r in (3.2e-5, 3.7e-5, 1.07e-3, 2.58e-3)]
    refused, bounds = screen_norms(sizes, RobustPolicy(), recent=0.0045)
    assert refused == {} and bounds == {}
    attacked = [*sizes, UpdateSize(100 * 2.58e-3 * 72.6, 5268)]
    assert list(screen_norms(attacked, RobustPolicy(), recent=0.0045)[0]) == [4]


def test_a_few_closely_agreeing_boards_do_not_make_a_slightly_negative_honest_one_an_outlier() -> None:
    """Measured on HeteroFL (synthetic data, four boards): three cosines within 0.02 of +0.265 and one honest
    board at -0.029. The deviations' median was ~0.01, so -0.029 stood '6 deviations' out and was refused; the
    spread is now at least MIN_SPREAD. A sign flip in a round that agrees (cosines near +0.8) is still refused."""
    policy = RobustPolicy(min_update_cosine=0.0)
    assert direction_outliers([0.255, 0.265, 0.275, -0.029], policy) == {}
    assert list(direction_outliers([0.8, 0.75, 0.82, 0.78, -0.78], policy)) == [4]


@settings(max_examples=300, deadline=None)
@given(
    base=st.floats(1e-6, 1e3),
    multiples=st.lists(
        st.one_of(st.floats(0.05, 15.0), st.sampled_from([math.inf, 0.0, 1.0, 10.0])), min_size=1, max_size=12
    ),
    elements=st.integers(1, 10_000),
    recent=st.one_of(st.none(), st.floats(0.0, 1e3)),
)
def test_the_honest_round_shortcut_decides_as_update_by_update(
    base: float, multiples: list[float], elements: int, recent: float | None
) -> None:
    """A round whose rms are all within the factor of each other skips the per-update references: whatever
    the round (spreads either side of the factor, exactly at it, zeros, non-finite), the result is the one the
    update-by-update screen gives."""
    from nestling.server.screening import _screen_each

    sizes = [UpdateSize(base * multiple, elements) for multiple in multiples]
    policy = RobustPolicy()
    assert screen_norms(sizes, policy, recent) == _screen_each(sizes, [s.rms for s in sizes], policy, recent)
