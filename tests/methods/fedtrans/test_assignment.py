"""Assignment and utilities (METHODS §4.b 4, 5): softmax over compatible models, seeded draws, and the Eq. 4
update with standardised losses × similarity."""

from __future__ import annotations

from collections import Counter

import pytest

from nestling.errors import ConfigError
from nestling.methods.fedtrans import (
    TrainingReport,
    assignment_probabilities,
    compatible_models,
    inherit_utilities,
    sample_model,
    standardised_losses,
    update_utilities,
)


def test_compatible_models_fit_the_capacity() -> None:
    assert compatible_models([10, 20, 40, 80], 40) == [0, 1, 2]
    assert compatible_models([10, 20], 5) == []


def test_probabilities_are_a_softmax_over_the_compatible_models_only() -> None:
    p = assignment_probabilities([0.3, -1.0, 2.0, 5.0], [0, 1, 2])
    assert sum(p) == pytest.approx(1.0)
    assert p[3] == 0.0
    assert p[2] > p[0] > p[1]
    assert p[2] / p[0] == pytest.approx(2.718281828 ** (2.0 - 0.3))
    assert assignment_probabilities([4.0, 4.0, 4.0, 9.0], [0, 1, 2]) == pytest.approx(
        [1 / 3, 1 / 3, 1 / 3, 0.0]
    )
    assert sum(assignment_probabilities([1000.0, -1000.0], [0, 1])) == pytest.approx(1.0)  # no overflow


def test_a_client_that_fits_nothing_is_refused() -> None:
    with pytest.raises(ConfigError, match="fits no model"):
        assignment_probabilities([0.0], [])
    with pytest.raises(ConfigError, match=r"compatible models \[3\]"):
        assignment_probabilities([0.0], [3])


def test_draws_are_seeded_per_round_and_client_and_follow_the_probabilities() -> None:
    utilities, compatible = [0.0, 1.0, 0.5], [0, 1]
    first = sample_model(utilities, compatible, seed=3, round_index=7, client="board-1")
    assert all(
        sample_model(utilities, compatible, seed=3, round_index=7, client="board-1") == first
        for _ in range(5)
    )
    draws = Counter(
        sample_model(utilities, compatible, seed=3, round_index=r, client="board-1") for r in range(4000)
    )
    assert set(draws) <= {0, 1}
    expected = assignment_probabilities(utilities, compatible)[1]
    assert draws[1] / 4000 == pytest.approx(expected, abs=0.03)
    clients = {sample_model([0.0, 0.0], [0, 1], seed=3, round_index=0, client=f"c{i}") for i in range(40)}
    assert clients == {0, 1}  # clients draw independently within a round


def test_losses_are_standardised_among_clients_of_the_same_model() -> None:
    reports = [
        TrainingReport("a", 0, 1.0),
        TrainingReport("b", 0, 3.0),
        TrainingReport("c", 1, 9.0),
        TrainingReport("d", 2, 0.5),
        TrainingReport("e", 2, 0.5),
    ]
    scores = standardised_losses(reports)
    assert scores == {"a": -1.0, "b": 1.0, "c": 0.0, "d": 0.0, "e": 0.0}
    with pytest.raises(ConfigError, match="non-finite training loss"):
        standardised_losses([TrainingReport("a", 0, float("nan"))])


def test_a_high_loss_lowers_similar_models_more_and_leaves_dissimilar_ones() -> None:
    similarity = {(0, 0): 1.0, (1, 0): 0.8, (2, 0): 0.0, (0, 1): 0.8, (1, 1): 1.0, (2, 1): 0.0}
    utilities = {"hi": [0.0, 0.0, 0.0], "lo": [0.0, 0.0, 0.0], "idle": [1.0, 2.0, 3.0]}
    reports = [TrainingReport("hi", 0, 4.0), TrainingReport("lo", 0, 2.0)]
    compatible = {"hi": [0, 1, 2], "lo": [0, 1]}
    new = update_utilities(utilities, reports, compatible, lambda k, n: similarity[(k, n)])
    assert new["hi"][0] < new["hi"][1] < new["hi"][2] == 0.0  # L̃ = +1: the trained model falls most
    assert new["lo"][0] > new["lo"][1] > 0.0  # L̃ = -1: the trained model rises most
    assert new["lo"][2] == 0.0  # not compatible: unchanged
    assert new["idle"] == [1.0, 2.0, 3.0]
    assert utilities["hi"] == [0.0, 0.0, 0.0]  # the input is not changed in place


def test_a_new_model_starts_with_its_parents_utility() -> None:
    assert inherit_utilities({"a": [0.5, -1.0], "b": [0.0, 2.0]}, parent=1) == {
        "a": [0.5, -1.0, -1.0],
        "b": [0.0, 2.0, 2.0],
    }
