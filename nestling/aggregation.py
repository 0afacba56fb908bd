"""Masked (count-based) aggregation of nested submodels (METHODS §1.2).

w_e ← Σ_{k∈S_e} a_k w_{k,e} / Σ_{k∈S_e} a_k where S_e are the contributions whose submodel holds e;
elements no contribution holds keep their value. Contributions of the same submodel share one
region, so their weighted sum is accumulated straight into the global-shaped buffer and the
denominator is updated once per distinct region: every byte of every result is read once.

Robust rules (`robust_rule("trimmed_mean" | "median")`, chosen by the coordinator from [run]
aggregation) replace the weighted mean element by element over the contributions that hold each
element (regions and HeteroFL row masks respected), unweighted so a claimed sample count cannot buy
influence. Every strategy aggregates through masked_mean, so the rule reaches all of them.

BN running statistics have a rule of their own ([run] bn_statistics, `robust_rule(statistics=...)`):
"median" takes each channel's median over the boards holding it. They are a board's own word, not a step
the model took: one board of ten sending variances x3.9, x0.26 or means +2.9 sigma (each inside any bound
an honest round allows) took a FedAvg model to chance through the weighted mean, and moves a median by at
most one board's rank. "mean" is the papers' weighted mean.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from nestling.config import STATISTICS_RULES
from nestling.models.layers import is_running_statistic
from nestling.slicing import Region

ROBUST_RULES = ("mean", "trimmed_mean", "median")
_RULE: ContextVar[tuple[str, float, str]] = ContextVar(
    "nestling_aggregation_rule", default=("mean", 0.0, "mean")
)


@contextmanager
def robust_rule(rule: str, trim_fraction: float = 0.1, statistics: str = "mean") -> Iterator[None]:
    """Aggregate with `rule` inside the block (mean: each method's own weighted masked mean), and BN running
    statistics with `statistics` (median: per channel; a robust `rule` applies to them too)."""
    if rule not in ROBUST_RULES:
        raise ValueError(f"aggregation rule must be one of {ROBUST_RULES}, got {rule!r}")
    if not 0.0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
    if statistics not in STATISTICS_RULES:
        raise ValueError(f"BN statistics rule must be one of {STATISTICS_RULES}, got {statistics!r}")
    token = _RULE.set((rule, trim_fraction, statistics))
    try:
        yield
    finally:
        _RULE.reset(token)


@dataclass
class Contribution:
    """One client's tensors, the regions they occupy, and its aggregation weight a_k."""

    tensors: dict[str, torch.Tensor]
    regions: dict[str, Region]
    weight: float = 1.0
    row_masks: dict[str, torch.Tensor] = field(
        default_factory=dict
    )  # key -> bool over dim 0 (HeteroFL classes)


def masked_mean(
    global_state: dict[str, torch.Tensor], contributions: list[Contribution], keys: set[str] | None = None
) -> dict[str, torch.Tensor]:
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
    rule, trim, statistics = _RULE.get()
    if rule == "mean" and statistics == "median" and is_running_statistic(key):
        rule = "median"
    if rule != "mean":
        return _coordinatewise(old, key, group, rule, trim)
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


def _median_of_whole(old: torch.Tensor, key: str, group: list[Contribution]) -> torch.Tensor | None:
    """The element-wise median when every contribution holds all of `old`, unmasked and finite (a round's usual
    BN statistics): one stack and one sort, about what their weighted mean costs, where the general path's NaN
    padding took ~250 us a key. None otherwise."""
    if not all(c.tensors[key].shape == old.shape and key not in c.row_masks for c in group):
        return None
    dtype = torch.float64 if old.dtype == torch.float64 else torch.float32
    stack = torch.stack([c.tensors[key].to(dtype) for c in group])
    if bool(torch.isnan(stack).any()):  # NaN means 'not held' to the general path
        return None
    ordered = stack.sort(dim=0).values
    n = len(group)
    return ordered[(n - 1) // 2].add(ordered[n // 2]).mul_(0.5).to(old.dtype)


def _coordinatewise(
    old: torch.Tensor, key: str, group: list[Contribution], rule: str, trim: float
) -> torch.Tensor:
    """Trimmed mean or median per element over the contributions holding it (NaN marks 'not held')."""
    if rule == "median":
        whole = _median_of_whole(old, key, group)
        if whole is not None:
            return whole
    dtype = torch.float64 if old.dtype == torch.float64 else torch.float32
    stack = torch.full((len(group), *old.shape), float("nan"), dtype=dtype)
    for i, c in enumerate(group):
        tensor = c.tensors[key].to(dtype)
        mask = c.row_masks.get(key)
        if mask is not None:
            tensor = torch.where(mask.view(-1, *([1] * (tensor.dim() - 1))), tensor, torch.nan)
        stack[i][c.regions[key]] = tensor
    count = (~torch.isnan(stack)).sum(dim=0)
    ordered = torch.sort(stack, dim=0).values  # NaN (not held) sorts last
    position = torch.arange(len(group)).view(-1, *([1] * old.dim()))
    if rule == "median":
        low = ((count - 1).clamp_min(0) // 2).unsqueeze(0)
        high = (count // 2).clamp_max(len(group) - 1).unsqueeze(0)
        values = (ordered.gather(0, low) + ordered.gather(0, high)).squeeze(0) / 2
    else:
        cut = torch.floor(count.to(dtype) * trim).to(count.dtype)
        keep = (position >= cut) & (position < count - cut)
        values = torch.where(keep, ordered, 0).sum(dim=0) / (count - 2 * cut).clamp_min(1).to(dtype)
    return torch.where(count > 0, values, old.to(dtype)).to(old.dtype)
