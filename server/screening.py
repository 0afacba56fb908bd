"""Update screening and norm clipping: one bad board's result must not reach the global model.

A result's update is result − task weights over its floating tensors. Screening refuses (reason
`update_norm`) an update that is non-finite, larger than an absolute bound, or far larger than the
other results of the same round (factor × their median norm). Clipping scales an update down to a
bound (the DP-FedAvg style L2 bound) instead of refusing it. Both act before aggregation and only
read honest results, so an honest run whose updates pass is aggregated bit for bit as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from statistics import median

import torch

from nestling.config import RunSection
from nestling.errors import ConfigError
from nestling.messages import Result, Task

AGGREGATIONS = ("mean", "trimmed_mean", "median")


@dataclass(frozen=True)
class RobustPolicy:
    """What the coordinator does against bad updates ([run] screen_updates, max_update_norm, ...)."""

    screen_updates: bool = True
    max_update_norm: float | None = None  # absolute L2 bound on an update; None: only relative screening
    update_norm_factor: float = (
        10.0  # refuse an update this many times larger than the round's others (median)
    )
    clip_update_norm: float | None = None  # scale updates down to this L2 norm before aggregation
    aggregation: str = "mean"  # mean (each method's own), trimmed_mean or median (coordinate-wise)
    trim_fraction: float = 0.1  # share trimmed from each end per element by trimmed_mean
    divergence_guard: bool = True  # roll back a round that left the global model non-finite or exploded
    divergence_factor: float = (
        1e3  # the global model's largest |weight| may grow at most this much in one round
    )
    quarantine_rounds: int = 3  # rounds a device whose update was rolled back is not selected

    def __post_init__(self) -> None:
        checks = [
            (self.max_update_norm is None or self.max_update_norm > 0, "max_update_norm must be > 0"),
            (self.update_norm_factor > 1, "update_norm_factor must be > 1"),
            (self.clip_update_norm is None or self.clip_update_norm > 0, "clip_update_norm must be > 0"),
            (self.aggregation in AGGREGATIONS, f"aggregation must be one of {', '.join(AGGREGATIONS)}"),
            (0.0 <= self.trim_fraction < 0.5, "trim_fraction must be in [0, 0.5)"),
            (self.divergence_factor > 1, "divergence_factor must be > 1"),
            (self.quarantine_rounds >= 0, "quarantine_rounds must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"[run] {message}")


@dataclass(frozen=True)
class UpdateSize:
    """An update's L2 norm and element count; rms compares submodels of different sizes fairly."""

    norm: float
    elements: int

    @property
    def rms(self) -> float:
        return self.norm / math.sqrt(max(self.elements, 1))


def robust_policy(run: RunSection) -> RobustPolicy:
    """The [run] section's robustness settings (simulator and fleet read the same keys)."""
    return RobustPolicy(
        screen_updates=run.screen_updates,
        max_update_norm=run.max_update_norm,
        update_norm_factor=run.update_norm_factor,
        clip_update_norm=run.clip_update_norm,
        aggregation=run.aggregation,
        trim_fraction=run.trim_fraction,
        divergence_guard=run.divergence_guard,
        divergence_factor=run.divergence_factor,
        quarantine_rounds=run.quarantine_rounds,
    )


def update_size(task: Task, result: Result) -> UpdateSize:
    """L2 norm (float64) of result − task over the floating tensors the result carries; inf if non-finite."""
    pairs = [
        (value.detach(), task.weights[key].detach())
        for key, value in result.weights.items()
        if value.is_floating_point() and key in task.weights
    ]
    if not pairs:
        return UpdateSize(0.0, 0)
    trained, sent = [p[0] for p in pairs], [p[1] for p in pairs]
    # One fused pass per tensor list, in the tensors' own precision: an update whose norm overflows float32
    # is refused as non-finite.
    norms = torch._foreach_norm(torch._foreach_sub(trained, sent))
    total = float(torch.linalg.vector_norm(torch.stack([n.double() for n in norms])))
    return UpdateSize(total if math.isfinite(total) else math.inf, sum(t.numel() for t in trained))


def absolute_reason(size: UpdateSize, policy: RobustPolicy) -> str | None:
    """Why an update is refused on its own (non-finite, above the configured bound), or None."""
    if not math.isfinite(size.norm):
        return "non-finite update"
    if policy.max_update_norm is not None and size.norm > policy.max_update_norm:
        return f"update norm {size.norm:.3g} above the bound {policy.max_update_norm:.3g}"
    return None


def outliers(sizes: list[UpdateSize], policy: RobustPolicy) -> dict[int, str]:
    """Index -> reason for every update far outside the round: rms over factor x the others' median rms."""
    refused: dict[int, str] = {}
    for i, size in enumerate(sizes):
        others = [s.rms for j, s in enumerate(sizes) if j != i and math.isfinite(s.rms)]
        if not others:
            continue
        typical = median(others)
        if size.rms > policy.update_norm_factor * max(typical, 1e-12):
            refused[i] = (
                f"update rms {size.rms:.3g} over {policy.update_norm_factor:g}x "
                f"the round's median {typical:.3g}"
            )
    return refused


def clip_update(task: Task, result: Result, norm: float, bound: float) -> Result:
    """The result with its update scaled to L2 norm `bound` (unchanged when already within it)."""
    if norm <= bound:
        return result
    scale = bound / norm
    clipped = {}
    for key, value in result.weights.items():
        base = task.weights.get(key)
        if base is None or not value.is_floating_point():
            clipped[key] = value
            continue
        delta = value.to(torch.float64) - base.to(torch.float64)
        clipped[key] = (base.to(torch.float64) + delta * scale).to(value.dtype)
    return replace(result, weights=clipped)


def largest_magnitude(state: dict[str, torch.Tensor]) -> float:
    """max |w| over the floating tensors of a model state (inf when any value is non-finite)."""
    peaks = [
        torch.amax(value.abs()) for value in state.values() if value.is_floating_point() and value.numel()
    ]
    worst = float(torch.stack(peaks).max()) if peaks else 0.0  # NaN propagates through amax
    return worst if math.isfinite(worst) else math.inf
