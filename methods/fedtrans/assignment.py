"""Which model a client trains: capacity, utility-softmax sampling and the utility update (METHODS §4.a.2 2, 4).

Utilities are one list per client indexed by model (creation order). K_c = models whose MACs fit the client's
capacity T_c; p_k = exp(U_k) / Σ_{k'∈K_c} exp(U_k'). The draw is seeded by (seed, round, client), so a resumed
run draws the same. Update (Eq. 4): U_k ← U_k − L̃·sim(M_k, M_n) for every compatible k, L̃ the z-score of the
client's loss among this round's clients that trained the same model M_n (AMBIG-11 DECISION; 0 when that group
has one client or no spread).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from nestling.errors import ConfigError


@dataclass(frozen=True)
class TrainingReport:
    """What one participant reported this round: the model it trained and its training loss."""

    client: str
    model: int
    loss: float


def compatible_models(model_macs: Sequence[float], capacity: float) -> list[int]:
    """K_c: the models whose MACs fit a client of `capacity` MACs."""
    return [k for k, macs in enumerate(model_macs) if macs <= capacity]


def assignment_probabilities(utilities: Sequence[float], compatible: Sequence[int]) -> list[float]:
    """Softmax of the utilities over the compatible models; 0 for every other model."""
    if not compatible:
        raise ConfigError(
            "the client fits no model of the family (the seed model must fit the weakest client)"
        )
    outside = [k for k in compatible if not 0 <= k < len(utilities)]
    if outside:
        raise ConfigError(f"compatible models {outside} have no utility (models 0..{len(utilities) - 1})")
    top = max(utilities[k] for k in compatible)  # subtracted for a softmax that cannot overflow
    exps = {k: math.exp(utilities[k] - top) for k in set(compatible)}
    total = sum(exps.values())
    return [exps[k] / total if k in exps else 0.0 for k in range(len(utilities))]


def _client_key(client: str) -> int:
    return int.from_bytes(hashlib.sha256(client.encode()).digest()[:8], "little")


def sample_model(
    utilities: Sequence[float], compatible: Sequence[int], *, seed: int, round_index: int, client: str
) -> int:
    """Draw the model `client` trains in `round_index` (same arguments, same draw: resume-safe)."""
    probabilities = assignment_probabilities(utilities, compatible)
    generator = np.random.default_rng([seed, round_index, _client_key(client)])
    return int(generator.choice(len(probabilities), p=np.asarray(probabilities)))


def standardised_losses(reports: Sequence[TrainingReport]) -> dict[str, float]:
    """L̃ per client: z-score among this round's clients that trained the same model (AMBIG-11)."""
    by_model: dict[int, list[TrainingReport]] = {}
    for report in reports:
        if not math.isfinite(report.loss):
            raise ConfigError(f"client {report.client} reported a non-finite training loss {report.loss}")
        by_model.setdefault(report.model, []).append(report)
    scores: dict[str, float] = {}
    for group in by_model.values():
        mean = sum(r.loss for r in group) / len(group)
        spread = math.sqrt(sum((r.loss - mean) ** 2 for r in group) / len(group))
        for report in group:
            scores[report.client] = (report.loss - mean) / spread if spread > 0 else 0.0
    return scores


def update_utilities(
    utilities: Mapping[str, Sequence[float]],
    reports: Sequence[TrainingReport],
    compatible: Mapping[str, Sequence[int]],
    similarity: Callable[[int, int], float],
) -> dict[str, list[float]]:
    """New utilities after this round's reports (Eq. 4); clients that did not report are unchanged."""
    updated = {client: list(row) for client, row in utilities.items()}
    scores = standardised_losses(reports)
    for report in reports:
        if report.client not in updated:
            raise ConfigError(f"client {report.client} has no utilities")
        row = updated[report.client]
        for k in compatible[report.client]:
            row[k] -= scores[report.client] * similarity(k, report.model)
    return updated


def inherit_utilities(utilities: Mapping[str, Sequence[float]], parent: int) -> dict[str, list[float]]:
    """Every client's utilities with one more model appended, valued like its parent (Alg. 1, 8a)."""
    return {client: [*row, row[parent]] for client, row in utilities.items()}
