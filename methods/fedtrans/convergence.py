"""When to grow: the degree of convergence of the newest model's training loss (METHODS §4.a.2 step 7, Eq. 1).

DoC(i) = (1/γ) Σ_{q=0}^{γ-1} [L(i-q-δ) - L(i-q)] / δ: the mean loss decrease per round over γ slopes of
width δ, i = the newest entry. The series is the per-round mean training loss of the clients that trained
the newest model (AMBIG-13 DECISION: no further smoothing, Eq. 1 already averages γ slopes).
"""

from __future__ import annotations

from collections.abc import Sequence

from nestling.errors import ConfigError


def degree_of_convergence(losses: Sequence[float], gamma: int = 10, delta: int = 20) -> float | None:
    """DoC at the last entry of `losses`, or None while the history is shorter than γ + δ entries."""
    if gamma < 1 or delta < 1:
        raise ConfigError(f"DoC needs gamma >= 1 and delta >= 1, got gamma={gamma}, delta={delta}")
    if len(losses) < gamma + delta:
        return None
    last = len(losses) - 1
    slopes = ((losses[last - q - delta] - losses[last - q]) / delta for q in range(gamma))
    return sum(slopes) / gamma


def should_transform(
    losses: Sequence[float],
    newest_macs: float,
    largest_capacity: float,
    *,
    beta: float = 0.003,
    gamma: int = 10,
    delta: int = 20,
) -> bool:
    """Grow when the newest model's loss has flattened (DoC ≤ β) and a stronger client could hold more."""
    doc = degree_of_convergence(losses, gamma, delta)
    return doc is not None and doc <= beta and newest_macs < largest_capacity
