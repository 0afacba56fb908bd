"""Update screening and norm clipping: one bad board's result must not reach the global model.

A result's update is result − task weights over its floating tensors. Screening refuses (reason
`update_norm`) an update that is non-finite, larger than an absolute bound, or far larger than the
other results of the same round (factor × their upper quartile, in rms), and (reason `update_direction`) an update
that points against the round's consensus: its cosine with the mean of the other updates, compared on the
coordinates both touch (nested submodels are prefixes of the global tensors), below `min_update_cosine`. Clipping scales an update down to a
bound (the DP-FedAvg style L2 bound) instead of refusing it. The round-relative rule also looks back a few
rounds (`outliers`): an update between factor x the round's reference and factor x the largest median of the last
RECENT_ROUNDS rounds is kept, clipped to the round's bound, so it weighs no more than the largest update the
round-relative rule alone would have let through. Both act before aggregation and only
read honest results, so an honest run whose updates pass is aggregated bit for bit as before.

BN running statistics are measured from data, not trained: a submodel no board has trained yet has them leave
their initial values on its first update, a change 10-100x the round's trained updates, so they are not part of
the update's norm or direction. They are judged by their values instead: non-finite values and negative
variances are refused, and so is a statistics tensor whose rms is over factor x the round's others' upper quartile
for the same tensor (a board inflating a running variance to wreck every model evaluated with it).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, replace
from statistics import median

import torch
from torch._utils import _flatten_dense_tensors

from nestling.config import STATISTICS_RULES, RunSection
from nestling.errors import ConfigError
from nestling.messages import Result, Task
from nestling.models.layers import is_running_statistic
from nestling.server.flat_updates import (  # re-exported: screening's callers read updates through here
    FlatUpdate,
    UpdateSize,
    UpdateWorkspace,
    flat_update,
    update_size,
)
from nestling.server.running_statistics import REFERENCE_QUANTILE, quantile_without

__all__ = [
    "AGGREGATIONS",
    "RECENT_ROUNDS",
    "FlatUpdate",
    "GlobalLayout",
    "RobustPolicy",
    "UpdateSize",
    "UpdateWorkspace",
    "absolute_reason",
    "clip_update",
    "direction_cosines",
    "direction_outliers",
    "flat_update",
    "largest_magnitude",
    "outliers",
    "robust_policy",
    "screen_norms",
    "soft_bounds",
    "update_size",
]

AGGREGATIONS = ("mean", "trimmed_mean", "median")


@dataclass(frozen=True)
class RobustPolicy:
    """What the coordinator does against bad updates ([run] screen_updates, max_update_norm, ...)."""

    screen_updates: bool = True
    max_update_norm: float | None = None  # absolute L2 bound on an update; None: only relative screening
    update_norm_factor: float = (
        10.0  # refuse an update this many times larger than the round's others (upper quartile)
    )
    clip_update_norm: float | None = None  # scale updates down to this L2 norm before aggregation
    aggregation: str = "mean"  # mean (each method's own), trimmed_mean or median (coordinate-wise)
    trim_fraction: float = 0.1  # share trimmed from each end per element by trimmed_mean
    divergence_guard: bool = True  # roll back a round that left the global model non-finite or exploded
    divergence_factor: float = (
        1e3  # the global model's largest |weight| may grow at most this much in one round
    )
    quarantine_rounds: int = 3  # rounds a device whose update was rolled back is not selected
    strike_rounds: int = 5  # rounds a board the cohort screen keeps refusing is set aside (server/strikes.py)
    min_update_cosine: float = (
        -1.0  # refuse updates pointing against the others' mean (and off the round's); -1: off (issue 29)
    )
    max_sample_factor: float | None = (
        3.0  # a claim counts at most this x the fleet's median (server/influence.py)
    )
    max_weight_share: float | None = 0.3  # no result weighs more of its round than this (None: no bound)
    bn_statistics: str = (
        "median"  # BN running statistics aggregated per channel by median, or "mean" (papers')
    )
    bn_variance_factor: float = (
        4.0  # with "mean": running variances per channel vs the cohort (server/statistics_cohort.py)
    )
    bn_mean_sigmas: float = 3.0  # running means' shift from the cohort, in its standard deviations
    cohort_screen: bool = (
        True  # refuse updates far off their submodel cohort's direction (server/update_cohort.py)
    )

    def __post_init__(self) -> None:
        checks = [
            (self.max_update_norm is None or self.max_update_norm > 0, "max_update_norm must be > 0"),
            (self.update_norm_factor > 1, "update_norm_factor must be > 1"),
            (self.clip_update_norm is None or self.clip_update_norm > 0, "clip_update_norm must be > 0"),
            (self.aggregation in AGGREGATIONS, f"aggregation must be one of {', '.join(AGGREGATIONS)}"),
            (0.0 <= self.trim_fraction < 0.5, "trim_fraction must be in [0, 0.5)"),
            (
                self.bn_statistics in STATISTICS_RULES,
                f"bn_statistics must be one of {', '.join(STATISTICS_RULES)}",
            ),
            (self.divergence_factor > 1, "divergence_factor must be > 1"),
            (self.quarantine_rounds >= 0, "quarantine_rounds must be >= 0"),
            (self.strike_rounds >= 0, "strike_rounds must be >= 0 (0: off)"),
            (-1.0 <= self.min_update_cosine < 1.0, "min_update_cosine must be in [-1, 1) (-1: off)"),
            (self.max_sample_factor is None or self.max_sample_factor >= 1, "max_sample_factor must be >= 1"),
            (
                self.max_weight_share is None or 0 < self.max_weight_share <= 1,
                "max_weight_share must be in (0, 1]",
            ),
            (self.bn_variance_factor > 1, "bn_variance_factor must be > 1"),
            (self.bn_mean_sigmas > 0, "bn_mean_sigmas must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"[run] {message}")


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
        strike_rounds=run.strike_rounds,
        min_update_cosine=run.min_update_cosine,
        max_sample_factor=run.max_sample_factor or None,
        max_weight_share=run.max_weight_share or None,
        bn_statistics=run.bn_statistics,
        bn_variance_factor=run.bn_variance_factor,
        bn_mean_sigmas=run.bn_mean_sigmas,
        cohort_screen=run.cohort_screen,
    )


class GlobalLayout:
    """Where each element of a (nested) submodel's flat update sits in the flat global model.

    Width and depth slicing keep prefixes of every tensor (METHODS §1.1), so an update of shape s of a global
    tensor of shape S occupies its leading s-box. Positions are cached per key order and shapes."""

    def __init__(self, global_shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes = global_shapes
        self.offsets: dict[str, int] = {}
        total = 0
        for key, shape in global_shapes.items():
            self.offsets[key] = total
            total += math.prod(shape)
        self.size = total
        self._cache: dict[tuple[tuple[str, ...], tuple[tuple[int, ...], ...]], torch.Tensor | None] = {}
        self._last: tuple[tuple[str, ...], tuple[tuple[int, ...], ...], torch.Tensor | None] | None = None

    def positions(self, update: FlatUpdate) -> torch.Tensor | None:
        """Global flat index of every element of `update`, or None when it does not nest in the global model."""
        last = self._last
        if last is not None and update.keys is last[0] and update.shapes is last[1]:
            return last[2]  # the same (interned) key and shape tuples as last time: no hashing of them
        signature = (update.keys, update.shapes)
        if signature not in self._cache:
            self._cache[signature] = self._positions(update)
        self._last = (update.keys, update.shapes, self._cache[signature])
        return self._cache[signature]

    def _positions(self, update: FlatUpdate) -> torch.Tensor | None:
        parts = []
        for key, shape in zip(update.keys, update.shapes, strict=True):
            full = self.shapes.get(key)
            if (
                full is None
                or len(full) != len(shape)
                or any(s > f for s, f in zip(shape, full, strict=True))
            ):
                return None
            grid = torch.arange(math.prod(full), dtype=torch.int64).reshape(full) + self.offsets[key]
            parts.append(grid[tuple(slice(0, s) for s in shape)].reshape(-1))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def direction_cosines(
    updates: list[FlatUpdate], layout: GlobalLayout, workspace: UpdateWorkspace | None = None
) -> list[float | None]:
    """Each update's cosine with the mean of the others, per element over the others that touch it.

    Updates that do not nest in the global layout get None (not judged). Updates of one submodel layout are
    summed as plain vectors; only one scatter into the global vector and one gather back happen per distinct
    layout (a method has a handful), so the cost is a few vector passes per update. When all updates are of
    one layout and rows of `workspace`'s matrix, the sum and every u·S come from two matrix-vector products."""
    stacked = workspace.stacked(updates) if workspace is not None and len(updates) > 1 else None
    if stacked is not None and layout.positions(updates[0]) is not None:
        return _stacked_cosines(updates, *stacked)
    groups: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for i, update in enumerate(updates):
        where = layout.positions(update)
        if where is not None and update.vector.numel():
            groups.setdefault(id(where), (where, []))[1].append(i)
    cosines: list[float | None] = [None] * len(updates)
    sums = {}
    for key, (_, members) in groups.items():
        summed = updates[members[0]].vector.clone()
        for i in members[1:]:
            summed.add_(updates[i].vector)
        sums[key] = summed
    if (
        len(groups) == 1
    ):  # one layout (FedAvg, every board on one submodel): no scatter into the global vector
        ((key, (_, members)),) = groups.items()
        if len(members) > 1:
            _uniform_cosines(updates, members, sums[key], cosines)
        return cosines
    total = torch.zeros(layout.size, dtype=torch.float32)
    count = torch.zeros(layout.size, dtype=torch.float32)
    for key, (where, members) in groups.items():
        total.index_add_(0, where, sums[key])
        count[where] += float(len(members))
    for where, members in groups.values():
        seen_total, others = total[where], count[where] - 1.0
        # mean of the others per element = (S - u) / others; with w = 1 / others (0 where only u touches):
        # u·mean = u·(S w) - (u²)·w and |mean|² = S²·w² - 2 u·(S w²) + (u²)·w², so each update costs a few dots.
        weight = torch.where(others > 0, 1.0 / others.clamp(min=1.0), torch.zeros_like(others))
        uniform = bool((others == others[0]).all()) and float(others[0]) > 0
        if uniform:  # the common case: every element seen by the same updates; the constant 1/others cancels
            _uniform_cosines(updates, members, seen_total, cosines)
            continue
        weighted, weighted2 = seen_total * weight, seen_total * weight * weight
        total_sq = float(torch.dot(seen_total * seen_total, weight * weight))
        shared, weight_sq = (weight > 0).float(), weight * weight
        for i in members:
            u = updates[i].vector
            squares = u * u
            u_sq = float(torch.dot(squares, shared))
            dot = float(torch.dot(u, weighted)) - float(torch.dot(squares, weight))
            mean_sq = total_sq - 2.0 * float(torch.dot(u, weighted2)) + float(torch.dot(squares, weight_sq))
            denominator = math.sqrt(max(u_sq, 0.0) * max(mean_sq, 0.0))
            cosines[i] = dot / denominator if denominator > 0 else None
    return cosines


def _stacked_cosines(updates: list[FlatUpdate], matrix: torch.Tensor, rows: list[int]) -> list[float | None]:
    """Cosines of updates of one layout held as rows of `matrix`: S and M S in one pass each; u·u is the norm
    measured on arrival. As `_uniform_cosines`, u·(S − u) / (|u| |S − u|)."""
    if sorted(rows) == list(range(len(rows))):  # the usual case: the round's first rows, read in place
        span = matrix[: len(rows)]
    else:  # some were refused: copy the others out (a refused row may hold anything, even inf)
        span, rows = matrix[rows], list(range(len(rows)))
    total = span.sum(dim=0)
    with_total = torch.mv(span, total).tolist()
    total_sq = math.fsum(with_total)  # S·S = Σ u·S
    cosines: list[float | None] = []
    for update, row in zip(updates, rows, strict=True):
        u_sq, u_total = update.size.norm**2, with_total[row]
        mean_sq = total_sq - 2.0 * u_total + u_sq
        denominator = math.sqrt(max(u_sq, 0.0) * max(mean_sq, 0.0))
        cosines.append((u_total - u_sq) / denominator if denominator > 0 else None)
    return cosines


def _uniform_cosines(
    updates: list[FlatUpdate], members: list[int], seen_total: torch.Tensor, cosines: list[float | None]
) -> None:
    """Cosines where every element of these updates is seen by the same updates (sum S over them):
    u·(S − u) / (|u| |S − u|), from u·u, u·S and S·S."""
    total_sq = float(torch.dot(seen_total, seen_total))
    for i in members:
        u = updates[i].vector
        u_sq, u_total = float(torch.dot(u, u)), float(torch.dot(u, seen_total))
        mean_sq = total_sq - 2.0 * u_total + u_sq
        denominator = math.sqrt(max(u_sq, 0.0) * max(mean_sq, 0.0))
        cosines[i] = (u_total - u_sq) / denominator if denominator > 0 else None


DIRECTION_SPREAD = (
    6.0  # an update is off-consensus only this many median absolute deviations below the median
)
CONSENSUS = 0.2  # below this median cosine a round has no common direction to defend
# The spread is at least this: with a few boards whose cosines happen to agree closely (three honest HeteroFL
# boards within 0.02 of +0.265), the deviations' median is ~0 and an honest board at -0.03 stood "6 deviations" out.
MIN_SPREAD = 0.1


def direction_outliers(cosines: list[float | None], policy: RobustPolicy) -> dict[int, str]:
    """Index -> reason for updates pointing against the others' mean.

    An update is refused when its cosine is below `min_update_cosine` AND an outlier among the round's cosines
    (more than DIRECTION_SPREAD median absolute deviations, at least MIN_SPREAD each, below their median), in a
    round whose median cosine is at least CONSENSUS. Measured on honest Dirichlet(0.1) and (0.5) digits runs (docs/benchmarks.md): FedAvg,
    FjORD, NeFL and DepthFL updates agree (cosines with the others' mean above +0.21, medians +0.75..+0.92), so
    a sign-flipped update stands far out; HeteroFL's and ScaleFL's honest updates do not (medians -0.17..+0.03,
    down to -0.49), so their rounds have no consensus and nothing is refused on direction there. Needs at least
    three judged updates (with two, each is the other's only reference) and refuses at most a minority."""
    bound = policy.min_update_cosine
    judged = [c for c in cosines if c is not None]
    if bound <= -1.0 or len(judged) < 3:
        return {}
    centre = median(judged)
    if centre < CONSENSUS:
        return {}
    spread = max(median(abs(c - centre) for c in judged), MIN_SPREAD)
    cut = min(bound, centre - DIRECTION_SPREAD * spread)
    refused = {
        i: f"update cosine {c:+.3f} with the other updates' mean below {cut:+.3f} (round median {centre:+.3f})"
        for i, c in enumerate(cosines)
        if c is not None and c < cut
    }
    return refused if 2 * len(refused) < len(judged) else {}


def absolute_reason(size: UpdateSize, policy: RobustPolicy) -> str | None:
    """Why an update is refused on its own (non-finite, above the configured bound), or None."""
    if not math.isfinite(size.norm):
        return "non-finite update"
    if policy.max_update_norm is not None and size.norm > policy.max_update_norm:
        return f"update norm {size.norm:.3g} above the bound {policy.max_update_norm:.3g}"
    return None


RECENT_ROUNDS = 10  # rounds whose largest median update size `outliers` also measures against (see there)


def _others_reference(rms: list[float]) -> list[float | None]:
    """Each update's reference: the upper quartile (REFERENCE_QUANTILE) of the rms of the round's other finite
    updates (None: no other). Not their median: honest rounds can be bimodal (DynamicFL's capacity tiers sent
    3e-5 and 2.6e-3 in one round of four boards, and the median sat in the lower mode)."""
    finite = sorted(r for r in rms if math.isfinite(r))
    if len(finite) < 2:
        return [None if math.isfinite(r) or not finite else finite[-1] for r in rms]
    whole = quantile_without(finite, None, REFERENCE_QUANTILE)
    return [
        quantile_without(finite, bisect_left(finite, r), REFERENCE_QUANTILE) if math.isfinite(r) else whole
        for r in rms
    ]


def outliers(sizes: list[UpdateSize], policy: RobustPolicy, recent: float | None = None) -> dict[int, str]:
    """Index -> reason for every update far outside the round: rms over factor x the upper quartile of the others'
    rms, and over factor x `recent` (the largest round median update of the last RECENT_ROUNDS rounds) when that is
    larger.

    Late in a run the boards' updates on data their submodel has learned shrink 10-30x (ResNet-20 NeFL on
    digits: round medians 0.02 at round 3, 0.0006 at round 8), while a board whose data is new to its submodel
    (re-planned onto it, or back after missing deadlines) still moves it as much as updates did a few rounds
    before: measured against the round alone it was refused every round. Such updates are kept, scaled down to
    the round's bound (`soft_bounds`)."""
    return screen_norms(sizes, policy, recent)[0]


def soft_bounds(sizes: list[UpdateSize], policy: RobustPolicy) -> dict[int, float]:
    """Index -> the L2 norm to clip an update to, for updates over factor x the round's others' reference rms
    (those `outliers` let pass because recent rounds' updates were as large): factor x that reference in rms."""
    return screen_norms(sizes, policy)[1]


def screen_norms(
    sizes: list[UpdateSize], policy: RobustPolicy, recent: float | None = None
) -> tuple[dict[int, str], dict[int, float]]:
    """`outliers` and `soft_bounds` together, each update's reference worked out once (the coordinator
    needs both every round). A bound is given for refused updates too; the caller skips those."""
    rms = [size.rms for size in sizes]
    if (
        len(rms) > 1
        and math.isfinite(largest := max(rms))
        and largest <= policy.update_norm_factor * min(rms)
    ):
        # the honest round: every rms within factor of every other, so of every reference (none is below
        # the smallest, and `recent` only raises it): nothing refused or bounded, no quantiles to work out
        return {}, {}
    return _screen_each(sizes, rms, policy, recent)


def _screen_each(
    sizes: list[UpdateSize], rms: list[float], policy: RobustPolicy, recent: float | None
) -> tuple[dict[int, str], dict[int, float]]:
    """`screen_norms` update by update, against each one's reference."""
    refused: dict[int, str] = {}
    bounds: dict[int, float] = {}
    factor = policy.update_norm_factor
    for i, (size, typical, mine) in enumerate(zip(sizes, _others_reference(rms), rms, strict=True)):
        if typical is None:
            continue
        reference = max(typical, recent or 0.0)
        if mine > factor * max(reference, 1e-12):
            against = f"the round's others' upper quartile {typical:.3g}"
            if reference > typical:
                against += f" and the last rounds' largest {reference:.3g}"
            refused[i] = f"update rms {mine:.3g} over {factor:g}x {against}"
        if math.isfinite(mine) and mine > factor * typical:
            bounds[i] = factor * typical * math.sqrt(max(size.elements, 1))
    return refused, bounds


def clip_update(task: Task, result: Result, norm: float, bound: float) -> Result:
    """The result with its trained tensors' update scaled to L2 norm `bound` (unchanged when already within
    it); BN running statistics are data, not a step, and are kept as uploaded."""
    if norm <= bound:
        return result
    scale = bound / norm
    clipped = {}
    for key, value in result.weights.items():
        base = task.weights.get(key)
        if base is None or not value.is_floating_point() or is_running_statistic(key):
            clipped[key] = value
            continue
        delta = value.to(torch.float64) - base.to(torch.float64)
        clipped[key] = (base.to(torch.float64) + delta * scale).to(value.dtype)
    return replace(result, weights=clipped)


def largest_magnitude(state: dict[str, torch.Tensor]) -> float:
    """max |w| over the floating tensors of a model state (inf when any value is non-finite).

    One flattening C++ call and one min-max pass: a fraction of a per-tensor inf-norm's cost."""
    values = [value for value in state.values() if value.is_floating_point()]
    if not values:
        return 0.0
    flat = _flatten_dense_tensors(values) if len(values) > 1 else values[0]
    if not flat.numel():
        return 0.0
    lowest, highest = (float(v) for v in torch.aminmax(flat))  # one pass; NaN anywhere makes both NaN
    worst = max(-lowest, highest)
    return worst if math.isfinite(lowest) and math.isfinite(highest) else math.inf
