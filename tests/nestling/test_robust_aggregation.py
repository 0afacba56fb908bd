"""Coordinate-wise trimmed mean and median over the contributions holding each element (nested regions, row
masks), and the default rule left exactly as it was."""

from __future__ import annotations

import pytest
import torch

from nestling.aggregation import Contribution, masked_mean, robust_rule


def nested(values: list[float], sizes: list[int], weights: list[float] | None = None) -> list[Contribution]:
    """Contributions of a length-4 vector whose k-th client holds only its first sizes[k] elements."""
    weights = weights or [1.0] * len(values)
    return [
        Contribution({"w": torch.full((n,), v)}, {"w": (slice(0, n),)}, weight)
        for v, n, weight in zip(values, sizes, weights, strict=True)
    ]


def test_median_uses_only_the_clients_that_hold_each_element() -> None:
    old = {"w": torch.full((4,), -7.0)}
    group = nested([1.0, 2.0, 100.0], [4, 2, 3])
    with robust_rule("median"):
        new = masked_mean(old, group)["w"]
    # element 0, 1: {1, 2, 100} -> 2; element 2: {1, 100} -> 50.5; element 3: {1} -> 1
    assert new.tolist() == [2.0, 2.0, 50.5, 1.0]


def test_trimmed_mean_drops_the_extremes_per_element_and_ignores_weights() -> None:
    old = {"w": torch.zeros(4)}
    group = nested([1.0, 2.0, 3.0, 4.0, 1e30], [4, 4, 4, 4, 4], weights=[1.0, 1.0, 1.0, 1.0, 1e9])
    with robust_rule("trimmed_mean", 0.2):
        new = masked_mean(old, group)["w"]
    assert torch.allclose(new, torch.full((4,), 3.0))  # one of five trimmed from each end: mean of 2, 3, 4


def test_robust_rules_respect_row_masks_and_leave_unheld_elements() -> None:
    old = {"w": torch.full((3, 2), 5.0)}
    held_rows = torch.tensor([True, False, False])
    group = [
        Contribution(
            {"w": torch.full((3, 2), 1.0)}, {"w": (slice(0, 3), slice(0, 2))}, 1.0, {"w": held_rows}
        ),
        Contribution({"w": torch.full((2, 2), 3.0)}, {"w": (slice(0, 2), slice(0, 2))}, 1.0),
    ]
    with robust_rule("median"):
        new = masked_mean(old, group)["w"]
    assert new.tolist() == [[2.0, 2.0], [3.0, 3.0], [5.0, 5.0]]  # row 2: nobody holds it


def test_mean_is_the_default_and_unchanged_outside_the_block() -> None:
    old = {"w": torch.zeros(4)}
    group = nested([1.0, 4.0], [4, 4], weights=[3.0, 1.0])
    before = masked_mean(old, group)["w"]
    with robust_rule("median"):
        pass
    assert torch.equal(masked_mean(old, group)["w"], before)
    with robust_rule("mean"):
        assert torch.equal(masked_mean(old, group)["w"], before)
    assert before.tolist() == [1.75] * 4


def test_integer_buffers_keep_their_rule_and_bad_rules_are_named() -> None:
    old = {"n": torch.tensor(3)}
    group = [Contribution({"n": torch.tensor(v)}, {"n": ()}) for v in (2, 9, 4)]
    with robust_rule("median"):
        assert int(masked_mean(old, group)["n"]) == 9
    with pytest.raises(ValueError, match="aggregation rule"), robust_rule("mode"):
        pass


def statistics_group(values: list[list[float]], sizes: list[int], weights: list[float]) -> list[Contribution]:
    """Boards' running variances of a 4-channel BN (prefixes of sizes[k] channels) beside a trained weight."""
    return [
        Contribution(
            {"bn.running_var": torch.tensor(v[:n]), "bn.weight": torch.tensor(v[:n])},
            {"bn.running_var": (slice(0, n),), "bn.weight": (slice(0, n),)},
            weight,
        )
        for v, n, weight in zip(values, sizes, weights, strict=True)
    ]


@pytest.mark.parametrize("sizes", [[4, 4, 4, 4], [4, 4, 2, 4]])
def test_the_statistics_median_takes_bn_statistics_only_per_channel_over_their_holders(sizes) -> None:
    """[run] bn_statistics = "median": running statistics by their per-channel median over the boards holding
    each channel (unweighted: a claimed sample count buys nothing), trained tensors by the method's mean."""
    values = [[1.0, 2.0, 3.0, 4.0], [1.2, 2.2, 3.2, 4.2], [3.9, 7.8, 11.7, 15.6], [0.9, 1.9, 2.9, 3.9]]
    weights = [1.0, 1.0, 1e6, 1.0]  # the liar (x3.9 statistics) also claims the samples
    old = {"bn.running_var": torch.zeros(4), "bn.weight": torch.zeros(4)}
    group = statistics_group(values, sizes, weights)
    with robust_rule("mean", statistics="median"):
        new = masked_mean(old, group)
    with robust_rule("median"):
        everything = masked_mean(old, group)
    assert torch.equal(
        new["bn.running_var"], everything["bn.running_var"]
    )  # the fast path is the general one
    held = [[v[c] for v, n in zip(values, sizes, strict=True) if c < n] for c in range(4)]
    expected = [
        float(torch.tensor(h).sort().values[(len(h) - 1) // 2 : len(h) // 2 + 1].mean()) for h in held
    ]
    assert new["bn.running_var"].tolist() == pytest.approx(expected)
    with robust_rule("mean"):
        assert torch.equal(new["bn.weight"], masked_mean(old, group)["bn.weight"])  # trained: the mean
    with robust_rule("mean", statistics="mean"):
        averaged = masked_mean(old, group)["bn.running_var"]
    assert float(averaged[0]) == pytest.approx(3.9, rel=1e-4)  # the papers' mean: the liar's value
    with pytest.raises(ValueError, match="BN statistics rule"), robust_rule("mean", statistics="mode"):
        pass


def test_a_non_finite_value_in_whole_tensors_is_not_held_as_in_the_general_median() -> None:
    """The one-sort median of whole tensors steps aside for a NaN, which the general path reads as 'not held'."""
    old = {"bn.running_var": torch.zeros(2)}
    values = [[1.0, 1.0], [2.0, float("nan")], [3.0, 5.0]]
    group = [
        Contribution({"bn.running_var": torch.tensor(v)}, {"bn.running_var": (slice(0, 2),)}) for v in values
    ]
    with robust_rule("mean", statistics="median"):
        assert masked_mean(old, group)["bn.running_var"].tolist() == [2.0, 3.0]
