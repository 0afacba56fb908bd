"""Client partitioners (METHODS §1.4): disjoint, right sizes, seeded, and as skewed as their alpha says."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nestling.data import (
    KNOWN_SCHEMES,
    dirichlet_balance_trick,
    dirichlet_balanced,
    iid,
    make_partition,
    match_label_distribution,
    mean_label_entropy,
    partition_summary,
    scalefl_chunks,
    shards,
    unbalanced,
)
from nestling.errors import ConfigError, DataError

LABELS = np.random.default_rng(0).integers(0, 10, size=5000)
CLIENTS = 20

# scheme, keywords, expected number of samples assigned in total for LABELS and CLIENTS
SCHEMES = [
    ("iid", {}, 5000),
    ("dirichlet", {"alpha": 0.5}, 5000),
    ("balanced-dirichlet", {"alpha": 0.5}, 5000),
    ("shards", {"classes_per_client": 2}, 5000),
    ("unbalanced", {"sigma": 1.0}, 5000),
    ("scalefl", {"alpha": 1.0, "group": 10}, 5000),
]


def test_every_scheme_is_covered_here() -> None:
    assert sorted(name for name, _, _ in SCHEMES) == sorted(KNOWN_SCHEMES)


@pytest.mark.parametrize(("scheme", "kw", "total"), SCHEMES)
def test_parts_are_disjoint_and_cover_the_expected_count(scheme: str, kw: dict, total: int) -> None:
    parts = make_partition(scheme, LABELS, CLIENTS, seed=1, **kw)
    assert len(parts) == CLIENTS
    assert all(p.dtype.kind == "i" for p in parts)
    joined = np.concatenate(parts)
    assert len(joined) == total and len(np.unique(joined)) == total
    assert joined.min() >= 0 and joined.max() < len(LABELS)


@pytest.mark.parametrize(("scheme", "kw", "total"), SCHEMES)
def test_same_seed_same_parts_other_seed_other_parts(scheme: str, kw: dict, total: int) -> None:
    first = make_partition(scheme, LABELS, CLIENTS, seed=7, **kw)
    again = make_partition(scheme, LABELS, CLIENTS, seed=7, **kw)
    other = make_partition(scheme, LABELS, CLIENTS, seed=8, **kw)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert any(not np.array_equal(a, b) for a, b in zip(first, other))


def test_iid_gives_equal_shards_and_leaves_the_remainder() -> None:
    parts = iid(103, 10, seed=0)
    assert [len(p) for p in parts] == [10] * 10
    assert len(np.unique(np.concatenate(parts))) == 100


def test_balanced_dirichlet_gives_exactly_d_over_n_each() -> None:
    labels = np.repeat(np.arange(10), 500)
    for alpha in (0.05, 0.5, 100.0):
        parts = dirichlet_balanced(labels, 100, alpha, seed=3)
        assert {len(p) for p in parts} == {50}
        assert len(np.unique(np.concatenate(parts))) == 5000


def test_balanced_dirichlet_with_tiny_alpha_still_fills_every_client() -> None:
    labels = np.repeat(np.arange(4), [400, 10, 10, 10])
    parts = dirichlet_balanced(labels, 10, 1e-3, seed=0)  # shares underflow to exactly 0
    assert {len(p) for p in parts} == {43}


@pytest.mark.parametrize(
    "partitioner",
    [
        lambda alpha, seed: dirichlet_balance_trick(LABELS, CLIENTS, alpha, seed),
        lambda alpha, seed: dirichlet_balanced(LABELS, CLIENTS, alpha, seed),
        lambda alpha, seed: scalefl_chunks(LABELS, CLIENTS, alpha, seed),
    ],
    ids=["balance-trick", "balanced", "scalefl"],
)
def test_small_alpha_skews_labels_more_than_large_alpha(partitioner) -> None:
    def entropy(alpha: float) -> float:
        return np.mean(
            [mean_label_entropy(partition_summary(partitioner(alpha, s), LABELS, 10)) for s in range(3)]
        )

    skewed, even = entropy(0.1), entropy(100.0)
    assert skewed < 0.6 * even
    assert even > 0.95 * np.log(10)  # large alpha is close to IID


def test_balance_trick_respects_min_size_and_caps_clients_before_each_class() -> None:
    parts = dirichlet_balance_trick(LABELS, CLIENTS, 0.1, seed=2, min_size=50)
    assert min(len(p) for p in parts) >= 50


def test_balance_trick_reports_an_unreachable_min_size() -> None:
    with pytest.raises(ConfigError, match=r"min_size 300 x 20 clients exceeds the 5000 samples"):
        dirichlet_balance_trick(LABELS, CLIENTS, 0.5, seed=0, min_size=300)


def test_shards_give_each_client_exactly_its_classes() -> None:
    parts = shards(LABELS, CLIENTS, 3, seed=4)
    summary = partition_summary(parts, LABELS, 10)
    assert ((summary > 0).sum(axis=1) == 3).all()
    holders_per_class = (summary > 0).sum(axis=0)
    assert set(holders_per_class.tolist()) == {6}  # 20 clients x 3 classes over 10 classes
    assert len({tuple(np.flatnonzero(row)) for row in summary}) > 3  # pairings vary


def test_unbalanced_sizes_vary_and_everything_is_assigned() -> None:
    parts = unbalanced(1000, 50, seed=0, sigma=1.5)
    sizes = np.array([len(p) for p in parts])
    assert sizes.sum() == 1000 and sizes.min() >= 1
    assert sizes.max() > 4 * sizes.min()
    assert {len(p) for p in unbalanced(1000, 50, seed=0, sigma=0.0)} == {20}


def test_scalefl_keeps_each_group_inside_its_own_chunk() -> None:
    parts = scalefl_chunks(LABELS, 25, 1.0, seed=0, group=10)  # groups of 10, 10 and 5 clients
    group_totals = [sum(len(p) for p in parts[a:b]) for a, b in ((0, 10), (10, 20), (20, 25))]
    assert group_totals == [2000, 2000, 1000]


def test_match_label_distribution_follows_the_reference_mix() -> None:
    train_labels = np.repeat(np.arange(10), 200)
    test_labels = np.repeat(np.arange(10), 100)
    train_parts = shards(train_labels, 10, 2, seed=0)
    test_parts = match_label_distribution(train_parts, train_labels, test_labels, seed=0)
    train_mix = partition_summary(train_parts, train_labels, 10) > 0
    test_mix = partition_summary(test_parts, test_labels, 10) > 0
    assert np.array_equal(train_mix, test_mix)
    assert len(np.unique(np.concatenate(test_parts))) == 1000


def test_partition_summary_counts_per_client_and_class() -> None:
    labels = np.array([0, 1, 1, 2, 2, 2])
    summary = partition_summary([np.array([0, 1]), np.array([2, 3, 4, 5])], labels, 4)
    assert summary.tolist() == [[1, 1, 0, 0], [0, 1, 3, 0]]
    with pytest.raises(DataError, match=r"labels reach 2 but num_classes is 2"):
        partition_summary([np.array([0])], labels, 2)


def test_dispatcher_errors_name_the_problem() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown scheme 'noniid' \(known: iid, dirichlet, balanced-dirichlet"
    ):
        make_partition("noniid", LABELS, 10, seed=0)
    with pytest.raises(ConfigError, match=r"alpha must be a finite number > 0, got 0"):
        make_partition("dirichlet", LABELS, 10, seed=0, alpha=0)
    with pytest.raises(ConfigError, match=r"alpha must be a finite number > 0"):
        make_partition("balanced-dirichlet", LABELS, 10, seed=0, alpha=-1.0)
    with pytest.raises(ConfigError, match=r"6 clients cannot share 5 samples"):
        make_partition("iid", np.arange(5), 6, seed=0)
    with pytest.raises(ConfigError, match=r"iid does not take alpha"):
        make_partition("iid", LABELS, 10, seed=0, alpha=0.5)
    with pytest.raises(ConfigError, match=r"classes_per_client must be an integer in 1..10"):
        make_partition("shards", LABELS, 10, seed=0, classes_per_client=11)
    with pytest.raises(ConfigError, match=r"labels must be a non-empty 1-D integer array"):
        make_partition("dirichlet", np.array([0.5, 1.5]), 2, seed=0)


@settings(max_examples=30, deadline=None)
@given(
    class_sizes=st.lists(st.integers(1, 40), min_size=2, max_size=6),
    num_clients=st.integers(1, 8),
    alpha=st.floats(0.05, 50.0),
    seed=st.integers(0, 2**16),
)
def test_balanced_dirichlet_property(
    class_sizes: list[int], num_clients: int, alpha: float, seed: int
) -> None:
    labels = np.repeat(np.arange(len(class_sizes)), class_sizes)
    assume(num_clients <= len(labels))
    parts = dirichlet_balanced(labels, num_clients, alpha, seed)
    per_client = len(labels) // num_clients
    assert [len(p) for p in parts] == [per_client] * num_clients
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined)
