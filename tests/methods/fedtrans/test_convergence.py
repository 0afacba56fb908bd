"""Degree of convergence (METHODS §4.b 3): the mean slope of a linear loss for any γ, δ; 0 for a flat one."""

from __future__ import annotations

import pytest

from nestling.errors import ConfigError
from nestling.methods.fedtrans import degree_of_convergence, should_transform


@pytest.mark.parametrize(("gamma", "delta"), [(1, 1), (10, 20), (3, 7), (10, 100)])
def test_a_linear_loss_gives_its_slope(gamma: int, delta: int) -> None:
    losses = [5.0 - 0.0125 * r for r in range(gamma + delta + 13)]
    assert degree_of_convergence(losses, gamma, delta) == pytest.approx(0.0125, abs=1e-12)


def test_a_flat_loss_has_converged_and_triggers_growth() -> None:
    flat = [0.7] * 30
    assert degree_of_convergence(flat, 10, 20) == 0.0
    assert should_transform(flat, newest_macs=1e6, largest_capacity=4e6)


def test_a_short_history_has_no_doc_and_never_grows() -> None:
    assert degree_of_convergence([1.0] * 29, 10, 20) is None
    assert not should_transform([1.0] * 29, newest_macs=1e6, largest_capacity=4e6)


def test_growth_waits_for_a_falling_loss_and_stops_at_the_largest_capacity() -> None:
    falling = [3.0 - 0.01 * r for r in range(40)]
    assert not should_transform(falling, newest_macs=1e6, largest_capacity=4e6, beta=0.003)
    assert should_transform(falling, newest_macs=1e6, largest_capacity=4e6, beta=0.02)
    assert not should_transform([0.7] * 30, newest_macs=4e6, largest_capacity=4e6)


def test_the_doc_uses_only_the_last_gamma_slopes() -> None:
    noisy_start = [9.0, 0.1, 7.0] + [1.0] * 30
    assert degree_of_convergence(noisy_start, 10, 20) == 0.0


def test_bad_window_sizes_are_refused() -> None:
    with pytest.raises(ConfigError, match="gamma >= 1 and delta >= 1"):
        degree_of_convergence([1.0] * 5, 0, 2)
