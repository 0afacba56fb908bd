"""FedTrans aggregation: FedAvg within each model, then soft aggregation from older to newer models (METHODS §4.a.2 5-6).

W_j ← [W̄_j + Σ_{i<j, i updated} η^t·sim(M_i, M_j)·embed_j(W̄_i)] / [1 + Σ_{i<j, i updated} η^t·sim(M_i, M_j)],
per element over the models whose embedding reaches that element (AMBIG-12 DECISION: the decayed weights
also renormalise, so every element is a convex combination; t = global round index). Only older (smaller)
models feed newer ones ("l2s" sharing is off, Table 1). A model without uploads this round keeps its weights
as its own term; it still receives from older models that had uploads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from nestling.errors import ConfigError
from nestling.growth.cells import State
from nestling.growth.lineage import Lineage, embed


def fedavg(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> State:
    """Weighted mean of same-shaped states (weights n_c); integer counters are taken from the first."""
    if not states or len(states) != len(weights):
        raise ConfigError(
            f"fedavg needs one weight per state, got {len(states)} states and {len(weights)} weights"
        )
    total = float(sum(weights))
    if total <= 0 or any(w < 0 for w in weights):
        raise ConfigError(f"fedavg weights must be >= 0 with a positive sum, got {list(weights)}")
    averaged: State = {}
    for key, first in states[0].items():
        if not first.is_floating_point():
            averaged[key] = first.clone()
            continue
        if any(s[key].shape != first.shape for s in states):
            raise ConfigError(f"fedavg: uploads disagree on the shape of {key}")
        accumulator = torch.zeros_like(first, dtype=torch.float64)
        for state, weight in zip(states, weights):
            accumulator += state[key].double() * (float(weight) / total)
        averaged[key] = accumulator.to(first.dtype)
    return averaged


def soft_aggregate(
    current: Sequence[Mapping[str, torch.Tensor]],
    averaged: Mapping[int, Mapping[str, torch.Tensor]],
    lineage: Lineage,
    round_index: int,
    eta: float = 0.98,
) -> list[State]:
    """Every model's new weights from this round's per-model FedAvg results `averaged` (model → W̄)."""
    if len(current) != len(lineage.parents):
        raise ConfigError(f"{len(current)} models given, the lineage holds {len(lineage.parents)}")
    if not 0.0 <= eta <= 1.0 or round_index < 0:
        raise ConfigError(
            f"soft aggregation needs 0 <= eta <= 1 and round_index >= 0, got {eta}, {round_index}"
        )
    unknown = sorted(set(averaged) - set(range(len(current))))
    if unknown:
        raise ConfigError(f"aggregates given for models {unknown} that do not exist")
    decay = eta**round_index
    result: list[State] = []
    for j, weights in enumerate(current):
        own = averaged.get(j, weights)
        donors = []
        for i in sorted(averaged):
            if i >= j:
                continue
            cells = lineage.correspondence(i, j)
            weight = decay * lineage.similarity(i, j)
            if cells is not None and weight > 0:
                donors.append((weight, embed(averaged[i], own, cells)))
        if not donors:
            result.append({key: tensor.clone() for key, tensor in own.items()})
            continue
        mixed: State = {}
        for key, tensor in own.items():
            pieces = [(w, placed[key]) for w, placed in donors if key in placed]
            if not pieces:
                mixed[key] = tensor.clone()
                continue
            numerator = tensor.double().clone()
            denominator = torch.ones_like(numerator)
            for weight, (older, region) in pieces:
                numerator[region] += weight * older.double()
                denominator[region] += weight
            mixed[key] = (numerator / denominator).to(tensor.dtype)
        result.append(mixed)
    return result
