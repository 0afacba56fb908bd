"""Masked (count-based) aggregation of nested submodels (METHODS §1.2).

w_e ← Σ_{k∈S_e} a_k w_{k,e} / Σ_{k∈S_e} a_k where S_e are the contributions whose submodel holds e;
elements no contribution holds keep their value. Contributions of the same submodel share one
region, so their weighted sum is accumulated straight into the global-shaped buffer and the
denominator is updated once per distinct region: every byte of every result is read once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from nestling.slicing import Region


@dataclass
class Contribution:
    """One client's tensors, the regions they occupy, and its aggregation weight a_k."""

    tensors: dict[str, torch.Tensor]
    regions: dict[str, Region]
    weight: float = 1.0
    row_masks: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> bool over dim 0 (HeteroFL classes)


def masked_mean(global_state: dict[str, torch.Tensor], contributions: list[Contribution],
                keys: set[str] | None = None) -> dict[str, torch.Tensor]:
    """New tensors for every key any contribution touched (others are not returned: unchanged)."""
    by_key: dict[str, list[Contribution]] = defaultdict(list)
    for contribution in contributions:
        for key in contribution.tensors:
            if keys is None or key in keys:
                by_key[key].append(contribution)
    updated: dict[str, torch.Tensor] = {}
    for key, group in by_key.items():
        updated[key] = _aggregate_key(global_state[key], key, group)
    return updated


def _aggregate_key(old: torch.Tensor, key: str, group: list[Contribution]) -> torch.Tensor:
    if not old.is_floating_point():
        # Integer buffers are BN batch counters; they only steer cumulative-average momentum.
        # DECISION: the largest reported counter wins (monotone progress, no float mean of ints).
        result = old.clone()
        for c in group:
            region = c.regions[key]
            result[region].copy_(torch.maximum(result[region], c.tensors[key]))
        return result
    acc = torch.zeros_like(old, dtype=torch.float64 if old.dtype == torch.float64 else torch.float32)
    weight_by_region: dict[tuple, float] = defaultdict(float)
    masked_count: torch.Tensor | None = None
    for c in group:
        region = c.regions[key]
        tensor = c.tensors[key]
        mask = c.row_masks.get(key)
        if mask is None:
            acc[region].add_(tensor, alpha=c.weight)
            weight_by_region[tuple((s.start, s.stop) for s in region)] += c.weight
        else:
            if masked_count is None:
                masked_count = torch.zeros_like(acc)
            rows = mask.to(acc.dtype).view(-1, *([1] * (tensor.dim() - 1)))
            acc[region].add_(tensor * rows, alpha=c.weight)
            masked_count[region].add_(rows.expand_as(tensor), alpha=c.weight)
    count = masked_count if masked_count is not None else torch.zeros_like(acc)
    for bounds, weight in weight_by_region.items():
        count[tuple(slice(a, b) for a, b in bounds)] += weight
    covered = count > 0
    result = torch.where(covered, acc / count.clamp_min(1e-12), old.to(acc.dtype))
    return result.to(old.dtype)

