"""Bounded influence: what a board claims about its samples can buy it only a bounded share of a round.

Every method weighs a result by the samples it says it trained on (METHODS §1.2, a_k = n_k), and a board's
sample count is its own word twice: in its hello and in each result. The coordinator already refuses a result
claiming more than its hello; a board lying in both, consistently, is caught only against the cohort:

1. A claim over `max_sample_factor` x the median sample count the fleet's boards registered (the devices
   available this round: one liar does not move their median) is not believed: it counts as that median, a
   typical board. Capping it at the bound instead left a liar 3 boards' weight (25 % of a round of ten), and a
   liar that also trains on flipped labels took FedAvg on digits from 75 % to 43 % in the few rounds its
   update passed the direction screens (benchmarks/robustness.py, 20 rounds). Honest Dirichlet partitions stay
   under 2x (the balance trick stops filling a client at |D|/N; the presets' worst board is 1.94x the median
   of its fleet), so the default of 3 leaves honest IID and Dirichlet runs unchanged. A deliberately
   unbalanced fleet (`partition = "unbalanced"`) should raise it.
2. No result weighs more than `max_weight_share` of the round's total (after 1.), or twice an equal share in
   rounds too small for that (2/n for n < 2/share): the largest are lowered together to the level where the
   cap holds (water-filling), the others keep their claims. The presets' worst honest share is 0.24 in rounds
   of 10, under the default 0.3.

Both change only `num_samples` of the results they bound (an integer, rounded down), so every strategy's own
weighting reads the bounded claim, and the aggregation is bit for bit what it was when nothing is bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from statistics import median

from nestling.messages import Result, Task


@dataclass(frozen=True)
class Bounded:
    """A round's results after the bound, and what was changed: task id -> (claimed, kept, why)."""

    accepted: list[tuple[Task, Result]]
    changed: dict[str, tuple[int, int, str]]


def sample_bound(registered: list[int], factor: float | None) -> float:
    """The most samples one result may claim: factor x the median registered count (inf: no bound)."""
    typical = typical_count(registered)
    if factor is None or typical is None:
        return math.inf
    return factor * typical


def typical_count(registered: list[int]) -> float | None:
    """The median registered sample count (None: nobody registered any): what a disbelieved claim counts as."""
    counts = [n for n in registered if n > 0]
    return float(median(counts)) if counts else None


def share_cap(count: int, share: float | None) -> float:
    """The largest share of the round one of `count` results may weigh (at least twice an equal share)."""
    if share is None or count < 2:
        return 1.0
    return min(1.0, max(share, 2.0 / count))


def capped_weights(weights: list[float], share: float) -> list[float]:
    """The weights with the largest lowered to one level t so that none exceeds `share` of the total:
    min(w_i, t) with t = share x Σ min(w_j, t) (water-filling; unchanged when the cap already holds)."""
    total = sum(weights)
    if share >= 1.0 or total <= 0 or max(weights) <= share * total:
        return list(weights)
    if len(weights) * share <= 1.0:  # only equal weights hold it: everyone lowered to the smallest
        return [min(weights)] * len(weights)
    ordered = sorted(weights, reverse=True)
    below = total
    for capped in range(1, len(ordered)):
        below -= ordered[capped - 1]  # the weights left as they are if the first `capped` are lowered to t
        level = share * below / (1.0 - capped * share)  # grows without bound as capped x share nears 1
        if capped == len(ordered) - 1 or ordered[capped] <= level:
            return [min(w, level) for w in weights]
    return list(weights)  # not reached: the loop ends with all but one lowered


def bound_influence(
    accepted: list[tuple[Task, Result]],
    registered: list[int],
    max_sample_factor: float | None,
    max_weight_share: float | None,
) -> Bounded:
    """The round's results with each `num_samples` bounded by the cohort (1.) and the round's share (2.)."""
    if not accepted:
        return Bounded(accepted, {})
    limit = sample_bound(registered, max_sample_factor)
    typical = typical_count(registered) or 0.0
    claims = [result.num_samples for _, result in accepted]
    kept = [float(claim) if claim <= limit else typical for claim in claims]  # factor >= 1: typical <= limit
    kept = capped_weights(kept, share_cap(len(kept), max_weight_share))
    bounded, changed = [], {}
    for (task, result), claim, weight in zip(accepted, claims, kept, strict=True):
        if weight >= claim:
            bounded.append((task, result))
            continue
        samples = max(1, math.floor(weight))
        why = (
            f"claims {claim} samples, over {max_sample_factor:g}x the fleet's median registered count: "
            f"counted as that median"
            if claim > limit and math.floor(typical) <= samples
            else f"claims {claim} samples, over {max_weight_share:g} of the round's total"
        )
        changed[result.task_id] = (claim, samples, why)
        bounded.append((task, replace(result, num_samples=samples)))
    return Bounded(bounded, changed)
