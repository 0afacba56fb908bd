"""BN running statistics judged channel by channel against the round's cohort (server/statistics_cohort.py):
the in-range poisoning of issue 25 is refused, honest non-IID spread is not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nestling.server.running_statistics import UploadedStatistics, measure
from nestling.server.statistics_cohort import cohort_outliers


def board(seed: int, channels: int = 16, spread: float = 0.3) -> dict[str, torch.Tensor]:
    """An honest board's statistics: per-channel variances near a common profile (x e^N(0, spread)) and
    means within a fraction of a standard deviation of a common profile."""
    common = torch.Generator().manual_seed(0)
    profile_var = torch.rand(channels, generator=common) * 2 + 0.5
    profile_mean = torch.randn(channels, generator=common)
    own = torch.Generator().manual_seed(100 + seed)
    variance = profile_var * torch.exp(spread * torch.randn(channels, generator=own))
    mean = profile_mean + 0.3 * profile_var.sqrt() * torch.randn(channels, generator=own)
    return {"bn.running_mean": mean, "bn.running_var": variance}


def judge(boards: list[dict[str, torch.Tensor]]) -> dict[int, str]:
    uploads = [UploadedStatistics(tuple(b), tuple(b.values())) for b in boards]
    return cohort_outliers(uploads, measure(uploads))


def test_honest_boards_with_non_iid_spread_are_not_refused() -> None:
    assert judge([board(i) for i in range(10)]) == {}
    assert judge([board(i, spread=0.6) for i in range(10)]) == {}  # variances 1.8x apart per channel


@pytest.mark.parametrize(
    "attack, named",
    [
        (lambda b: {**b, "bn.running_var": b["bn.running_var"] * 9}, "running variance bn.running_var"),
        (lambda b: {**b, "bn.running_var": torch.zeros(16)}, "running variance bn.running_var 0x"),
        (lambda b: {**b, "bn.running_var": torch.full((16,), 1e-30)}, "running variance bn.running_var"),
        (lambda b: {**b, "bn.running_var": b["bn.running_var"] / 9}, "running variance bn.running_var"),
        (
            lambda b: {**b, "bn.running_mean": b["bn.running_mean"] + 8 * b["bn.running_var"].sqrt()},
            "running mean bn.running_mean",
        ),
    ],
)
def test_in_range_poisoning_is_refused_by_name(attack, named: str) -> None:
    boards = [board(i) for i in range(10)]
    boards[3] = attack(boards[3])
    refused = judge(boards)
    assert list(refused) == [3] and named in refused[3], refused


def test_nested_prefixes_are_compared_on_the_channels_they_hold() -> None:
    """Boards of a narrower submodel hold a channel prefix; a narrow attacker is still measured on its own."""
    boards = [board(i) for i in range(6)] + [{k: v[:8] for k, v in board(i).items()} for i in range(6, 10)]
    assert judge(boards) == {}
    boards[8] = {**boards[8], "bn.running_var": boards[8]["bn.running_var"] * 9}
    assert list(judge(boards)) == [8]


def test_fewer_than_three_boards_are_not_judged_and_dead_channels_are_skipped() -> None:
    two = [board(0), {**board(1), "bn.running_var": torch.zeros(16)}]
    assert judge(two) == {}
    dead = [board(i) for i in range(5)]
    for b in dead:  # a channel every board measured as 0 (a dead ReLU before it): not evidence against anyone
        b["bn.running_var"][:2] = 0.0
    assert judge(dead) == {}


def test_tensors_a_board_left_as_sent_are_not_compared() -> None:
    """FjORD's boards send the statistics of widths they did not train as the task had them."""
    sent = {"bn.running_mean": torch.zeros(16), "bn.running_var": torch.ones(16)}
    boards = [board(i) for i in range(4)] + [dict(sent), dict(sent)]
    uploads = [UploadedStatistics(tuple(b), tuple(b.values()), sent=tuple(sent.values())) for b in boards]
    assert cohort_outliers(uploads, measure(uploads)) == {}


def test_the_one_layout_path_measures_as_the_key_by_key_path() -> None:
    """The usual round (one layout, all changed) is measured for all keys at once; it agrees with key by key."""
    from nestling.server.statistics_cohort import _fast_shifts, _rows, _slow_shifts

    boards = [board(i) for i in range(8)]
    for b in boards:
        b["conv.running_mean"], b["conv.running_var"] = (
            b["bn.running_mean"][:5] * 2,
            b["bn.running_var"][:5] + 1,
        )
    boards[2]["bn.running_var"] = boards[2]["bn.running_var"] * 9
    boards[2]["conv.running_var"] = boards[2]["conv.running_var"] * 9
    boards[5]["conv.running_mean"] = boards[5]["conv.running_mean"] + 8 * boards[5]["conv.running_var"].sqrt()
    boards[5]["bn.running_mean"] = boards[5]["bn.running_mean"] + 8 * boards[5]["bn.running_var"].sqrt()
    uploads = [UploadedStatistics(tuple(b), tuple(b.values())) for b in boards]
    measured, judged = measure(uploads), list(range(8))
    fast, slow = _fast_shifts(measured, judged), _slow_shifts(_rows(uploads, measured, judged))
    assert fast is not None and len(fast) == 1  # one layout: every key in one block
    (together,) = fast
    assert together.keys == tuple(k for s in slow for k in s.keys) == ("bn.running_var", "conv.running_var")
    assert together.mean_keys == tuple(k for s in slow for k in s.mean_keys)
    for s in slow:
        assert s.holders == together.holders == s.mean_holders == together.mean_holders
    assert np.allclose(together.variance, np.concatenate([s.variance for s in slow], axis=1))
    assert np.allclose(together.mean, np.concatenate([s.mean for s in slow], axis=1))
    # the poisoned entries are the ones out of bounds, and only they
    assert abs(together.variance[2, 0]) > np.log(4) and together.mean[5, 1] > 3
    assert list(cohort_outliers(uploads, measured)) == [2, 5]


def test_a_result_is_judged_by_the_median_of_its_tensors_not_its_worst() -> None:
    """The DynamicFL preset's first round: an honest board's deepest BN at 4.79x the round's, its others
    1.05-3.36x. A result with most of its tensors out of bounds is refused, one with a few is not."""
    keys = [f"blocks.{i}.bn" for i in range(7)]
    boards = [{f"{k}.running_var": board(i)["bn.running_var"] for k in keys} for i in range(10)]
    boards[4] = {**boards[4], f"{keys[-1]}.running_var": boards[4][f"{keys[-1]}.running_var"] * 4.8}
    boards[4].update({f"{k}.running_var": boards[4][f"{k}.running_var"] * 2.5 for k in keys[-3:-1]})
    assert judge(boards) == {}
    boards[7] = {k: v * 9 if n < 4 else v for n, (k, v) in enumerate(boards[7].items())}  # four of seven
    refused = judge(boards)
    assert list(refused) == [7] and "running variances' median ratio" in refused[7], refused


@pytest.mark.parametrize("judged", [list(range(8)), [0, 2, 3, 5, 7]])
def test_the_one_layout_path_agrees_with_dead_channels_a_dead_key_and_some_results_not_judged(judged) -> None:
    """Channels every board measured as 0, a key with no live channel at all, and a round where some results
    are left out (a problem of their own): the one-layout path still agrees with key by key."""
    from nestling.server.statistics_cohort import _fast_shifts, _rows, _slow_shifts

    boards = [board(i) for i in range(8)]
    for b in boards:
        b["bn.running_var"][[1, 4, 9]] = 0.0  # dead channels
        b["dead.running_mean"], b["dead.running_var"] = torch.zeros(4), torch.zeros(4)  # a dead key
        b["conv.running_mean"], b["conv.running_var"] = (
            b["bn.running_mean"][:5] * 2,
            b["bn.running_var"][:5] + 1,
        )
    boards[3]["conv.running_var"] = boards[3]["conv.running_var"] / 20
    uploads = [UploadedStatistics(tuple(b), tuple(b.values())) for b in boards]
    measured = measure(uploads)
    fast, slow = _fast_shifts(measured, judged), _slow_shifts(_rows(uploads, measured, judged))
    assert fast is not None and len(fast) == 1
    (together,) = fast
    assert together.keys == tuple(k for s in slow for k in s.keys) == ("bn.running_var", "conv.running_var")
    assert together.holders == judged
    assert np.allclose(together.variance, np.concatenate([s.variance for s in slow], axis=1))
    assert np.allclose(together.mean, np.concatenate([s.mean for s in slow], axis=1))
    with np.errstate(divide="ignore"):
        refused = cohort_outliers(uploads, measured)
    assert list(refused) == [3] and "conv.running_var" in refused[3]


def _refused_by_the_medians(boards: list[dict[str, torch.Tensor]]) -> bool:
    """Whether the median-over-channels judgement, run in full, refuses anyone."""
    from nestling.server.statistics_cohort import DEFAULT_MEAN_SIGMAS, DEFAULT_VARIANCE_FACTOR, _fast_shifts

    uploads = [UploadedStatistics(tuple(b), tuple(b.values())) for b in boards]
    measured = measure(uploads)
    with np.errstate(divide="ignore", invalid="ignore"):
        (shifts,) = _fast_shifts(measured, list(range(len(boards))))
    return bool(
        (np.abs(shifts.variance) > np.log(DEFAULT_VARIANCE_FACTOR)).any()
        or (shifts.mean > DEFAULT_MEAN_SIGMAS).any()
    )


def _certified(boards: list[dict[str, torch.Tensor]]) -> bool:
    from nestling.server.statistics_cohort import DEFAULT_MEAN_SIGMAS, DEFAULT_VARIANCE_FACTOR, _within_bounds

    uploads = [UploadedStatistics(tuple(b), tuple(b.values())) for b in boards]
    measured = measure(uploads)
    return _within_bounds(measured, list(range(len(boards))), DEFAULT_VARIANCE_FACTOR, DEFAULT_MEAN_SIGMAS)


def test_an_honest_round_is_certified_without_its_medians() -> None:
    """The usual round skips the medians: every channel's extremes already bound every result."""
    assert _certified([board(i) for i in range(10)])
    assert not _certified([board(i, spread=1.5) for i in range(10)])  # too spread out to certify: judged
    assert judge([board(i, spread=1.5) for i in range(10)]) == {}


@settings(max_examples=300, deadline=None)
@given(
    boards=st.integers(3, 10),
    spread=st.floats(0.0, 1.0),
    factor=st.floats(0.01, 12.0),
    shift=st.floats(-12.0, 12.0),
    attacked=st.integers(1, 16),
    dead=st.integers(0, 4),
)
def test_the_certificate_never_lets_a_refusal_through(
    boards: int, spread: float, factor: float, shift: float, attacked: int, dead: int
) -> None:
    """Whatever the cohort (spread, dead channels) and one board's poison on some of its channels (variances
    scaled, means shifted in standard deviations, near the bounds or far), a certified round is one the
    medians refuse nobody in."""
    cohort = [board(i, spread=spread) for i in range(boards)]
    for b in cohort:
        b["bn.running_var"][:dead] = 0.0
    poisoned = cohort[0]
    sigma = poisoned["bn.running_var"][:attacked].sqrt()
    poisoned["bn.running_var"][:attacked] *= factor
    poisoned["bn.running_mean"][:attacked] += shift * sigma
    if _certified(cohort):
        assert not _refused_by_the_medians(cohort)
