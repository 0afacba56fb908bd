"""The cohort update screen: an update far off its submodel cohort's direction is refused, on by default.

`server/screening.py`'s direction rule (`min_update_cosine`) is opt-in because an honest board of a skewed fleet
can point against the others. This screen judges each update against the other updates of its own submodel
(the same tensors and shapes) in the round, only in cohorts of at least COHORT_MIN, by its cosine with the
mean of the cohort's core (the half that agrees best with the others; `core_cosines`), and refuses it when
that cosine is

* below FLOOR, 0.5 (an update within 60 degrees of its cohort is never refused; on IID digits a sign flip sits
  at -0.91..-0.54, label-flipped training at -0.41..+0.06 after its first rounds and noise at -0.02..+0.03,
  against round medians of +0.56..+0.91. In its first rounds a label-flipped update still points downhill with
  everyone, +0.3..+0.5 against medians of +0.8..+0.9: a floor of 0.2 let it through there, where it did most
  of its harm, and 0.5 refuses it in those of them where it is 8 deviations out), and
* more than SPREADS robust deviations below the cohort's median cosine (the deviations' median, at least
  MIN_SPREAD each, widened in cohorts of fewer than twelve: SMALL_COHORT_WIDENING), and
* in a cohort whose median cosine is at least CONSENSUS, this round and over the submodel's recent rounds (the
  median of its last CONSENSUS_ROUNDS round medians, this one included), refusing at most a minority.

On a skewed fleet honest cosines spread out and their median falls (digits, 10 boards, 10 honest rounds: round
medians +0.19..+0.31 at Dirichlet(0.5), -0.19..+0.03 at Dirichlet(0.1)), so such rounds are not judged: the
screen acts where boards agree (IID: medians +0.59..+0.74, every honest board >= +0.43 and at most 5.3
deviations below the median), and there an update that points elsewhere stands out by tens of deviations.

One round is not enough to call a fleet agreeing. In the fedepth reproduction (CIFAR-10, balanced Dirichlet(0.3),
seed 2) round medians ran +0.03..+0.29 with two rounds at +0.427 and +0.431, and in the second an honest board
at -0.402 fell under the cut (-0.379); honest boards of that fleet reach -0.39 in rounds of median +0.19, so one
round's median and deviation say nothing of its tail. The submodel's recent round medians do (the median of the
last five: +0.07 at round 12, +0.24 at round 5): a cohort is judged only when they agree too (CONSENSUS_ROUNDS).
An IID fleet's medians stay above the line every round, so there this changes nothing; a minority of attackers
moves each round's median by a rank or so, as it moved the one round's before. A submodel with fewer than
COHORT_MIN updates in the round is not judged (the caller logs it).

It reads only what screening measured on arrival and never changes an update it does not refuse, so an honest
run that trips nothing is aggregated bit for bit as with the screen off.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from statistics import median

import numpy as np
import torch

from nestling.server.flat_updates import FlatUpdate, UpdateWorkspace

COHORT_MIN = 5  # fewer updates of one submodel in a round: not judged (one bad board among 4 sets the median)
FLOOR = 0.5  # an update must point less along its cohort than this (60 degrees) to be refused
SPREADS = 8.0  # ... and be this many robust deviations below the cohort's median cosine
MIN_SPREAD = 0.05  # a deviation counts at least this (a few closely agreeing boards: the MAD is near 0)
# A small cohort's deviation is taken this much wider than a cohort of ten's, so that its lowest honest update
# falls beyond the cut no more often. Its median and deviation rest on a few boards: of five Gaussian draws the
# lowest lies more than 8 deviations below the median in 5.5 % of draws, of ten in 1.5 %. Each factor is the
# n-draw quantile at ten's rate over 8 (recomputed by tests/server/test_update_cohort.py).
# An honest ScaleFL-preset DepthFL board was refused without it: cosine -0.063 in a cohort of five at the last
# learning rate, [-0.063, 0.206, 0.484, 0.496, 0.502], three boards agreeing within 0.018 and two spread below.
SMALL_COHORT_WIDENING = {5: 2.07, 6: 1.29, 7: 1.39, 8: 1.10, 9: 1.15, 11: 1.03}
# Boards on probation (set aside before for being refused, server/strikes.py) are refused this many deviations
# below the median. A label flipper back from its time aside passed its first round late in a 20-round run, where
# honest updates spread out and 8 deviations reach far, and that one round took FedAvg on digits from 70 % to 51 %.
# Honest boards reach 5.3 deviations at most, but an honest board is never on probation: it would have had to be
# refused twice in three judged rounds first.
PROBATION_SPREADS = 4.0
CONSENSUS = 0.4  # below this median cosine a cohort has no common direction to defend
# ... nor does a submodel whose round medians, over its last this many rounds (this one included), have a median
# below CONSENSUS: one round of a skewed fleet crossing the line by chance is not agreement.
CONSENSUS_ROUNDS = 5

Signature = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass
class CohortVerdict:
    """Index -> reason for each refused update, the updates of cohorts that had a consensus to judge them by
    (refused or not: server/strikes.py keeps each board's record of them), the cohorts too small to judge
    (submodel size -> count), and each measured cohort's median cosine this round (`cohort_key` -> median: the
    caller keeps them as the next rounds' `history`)."""

    refused: dict[int, str] = field(default_factory=dict)
    judged: set[int] = field(default_factory=set)
    unjudged: dict[int, int] = field(default_factory=dict)
    medians: dict[str, float] = field(default_factory=dict)


@lru_cache(maxsize=1024)
def signature(keys: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]) -> Signature:
    """Which submodel an update is of: its tensors and their shapes, whatever order they were sent in (worked
    out once per key order and shapes: the sort cost ~8 us an update, every round)."""
    return tuple(sorted(zip(keys, shapes, strict=True)))


def cohort_key(key: Signature) -> str:
    """A submodel's name in a run's records (metrics.jsonl): a digest of its tensors' names and shapes, the
    same in every process and every resume."""
    return hashlib.sha1(repr(key).encode()).hexdigest()[:12]


def cohort_outliers(
    updates: list[FlatUpdate],
    probation: frozenset[int] = frozenset(),
    workspace: UpdateWorkspace | None = None,
    history: Mapping[str, Sequence[float]] | None = None,
) -> CohortVerdict:
    """The refusals of one round: each cohort's updates against the mean of its core (`core_cosines`); the
    updates at the indices `probation` are held to PROBATION_SPREADS. `history` holds each submodel's median
    cosines of earlier rounds (`cohort_key` -> oldest first; CohortVerdict.medians has this round's): a cohort
    is judged only when those recent medians agree too. With the `workspace` the updates were measured in, a
    cohort whose rows are consecutive rows of its matrix is read as one block."""
    verdict = CohortVerdict()
    cohorts: dict[Signature, list[int]] = {}
    for i, update in enumerate(updates):
        if update.vector.numel():
            cohorts.setdefault(signature(update.keys, update.shapes), []).append(i)
    for key, members in cohorts.items():
        if len(members) < COHORT_MIN:
            size = updates[members[0]].size.elements
            verdict.unjudged[size] = verdict.unjudged.get(size, 0) + len(members)
            verdict.refused.update(_unproven(members, probation, f"a cohort of {len(members)}"))
            continue
        cohort = [updates[i] for i in members]
        gram = _gram(cohort, workspace) if workspace is not None else None
        cosines = list(zip(members, core_cosines(cohort, gram), strict=True))
        measured = [(i, c) for i, c in cosines if c is not None]
        name = cohort_key(key)
        if measured:
            verdict.medians[name] = median(c for _, c in measured)
        refused = _outliers(measured, probation, tuple((history or {}).get(name, ())))
        if refused is not None:
            verdict.refused.update(refused)
            verdict.judged.update(i for i, c in cosines if c is not None)
        else:
            verdict.refused.update(_unproven(members, probation, "a cohort without consensus"))
    return verdict


def _gram(cohort: list[FlatUpdate], workspace: UpdateWorkspace) -> list[list[float]] | None:
    """The cohort's Gram matrix, when its updates are rows of one of the workspace's matrices in the same key
    order (the usual round: packed results measured together): the one their measurement computed, or one
    product of their block when they sit in consecutive rows."""
    if any(update.keys != cohort[0].keys for update in cohort):
        return None
    measured = workspace.gram(cohort)
    if measured is not None:
        return measured
    stacked = workspace.stacked(cohort)
    if stacked is None:
        return None
    matrix, rows = stacked
    first = rows[0]
    if rows != list(range(first, first + len(rows))):
        return None
    block = matrix[first : first + len(rows)].numpy()
    with np.errstate(over="ignore", invalid="ignore"):  # a non-finite entry has no cosine (`_cosines`)
        return (block @ block.T).tolist()


def _unproven(members: list[int], probation: frozenset[int], why: str) -> dict[int, str]:
    """Boards on probation in a cohort that cannot be judged: refused, they have nothing to show they changed.
    Late in a run honest updates spread out and a round's median cosine falls under CONSENSUS; a label flipper
    back from its time aside passed exactly such a round (the last of 20) unjudged."""
    return {
        i: f"on probation (set aside before for the cohort screen's refusals) in {why}: not judged, not taken"
        for i in members
        if i in probation
    }


def core_cosines(cohort: list[FlatUpdate], gram: list[list[float]] | None = None) -> list[float | None]:
    """Each update's cosine with the mean of its cohort's core: the half of the cohort that agrees best with the
    others (the upper half of the cosines with the mean of the others), itself left out of that mean.

    Against the mean of all the others, an attacker is in every honest update's reference: a noise update 5x an
    honest norm spread the honest cosines of an IID round enough to hide in 2 of 10 rounds. The core leaves it out
    (a minority never reaches the upper half), so the honest cosines stay as tight as without it. The
    coordinate-wise median does the same at 100x the cost (5 ms a tinycnn round, 200 ms on ResNet-20): this is
    two sums and twenty dot products, or, given the cohort's `gram` matrix, sums of its entries."""
    if gram is not None:
        return _gram_cosines(gram)
    squares = [update.size.norm**2 for update in cohort]
    first = cohort[0]
    rows = [_in_order(update, first) for update in cohort]
    summed = _sum(rows)
    dots = [float(torch.dot(row, summed)) for row in rows]
    everyone = _cosines(dots, float(torch.dot(summed, summed)), squares, [True] * len(cohort))
    core = _core(everyone)
    if core is None:
        return everyone
    core_sum = _sum([row for row, inside in zip(rows, core, strict=True) if inside])
    dots = [float(torch.dot(row, core_sum)) for row in rows]
    return _cosines(dots, float(torch.dot(core_sum, core_sum)), squares, core)


def _core(cosines: list[float | None]) -> list[bool] | None:
    """Who is in the core: the upper half of the cosines with the others, the median included (None: fewer
    than two cosines, no core to speak of)."""
    ranked = sorted((c for c in cosines if c is not None), reverse=True)
    if len(ranked) < 2:
        return None
    threshold = ranked[(len(ranked) - 1) // 2]
    return [c is not None and c >= threshold for c in cosines]


def _gram_cosines(gram: list[list[float]]) -> list[float | None]:
    """`core_cosines` from the cohort's Gram matrix G = M Mᵀ (M: its updates as rows), one pass over the updates
    instead of two sums and twenty dot products (4 matrix-vector passes over ten ResNet-20 updates took 3.3 ms,
    G 2.9). Every quantity is a sum of G's entries: u_i·S = Σ_j G_ij and |S|² = Σ_ij G_ij for S the sum of the
    rows, over the core's columns for the core's sum; the squared norms are G's diagonal. G is a few dozen
    numbers, summed in Python (float64): numpy calls on it cost more than the sums, once per round."""
    squares = [row[i] for i, row in enumerate(gram)]
    dots = [sum(row) for row in gram]
    everyone = _cosines(dots, sum(dots), squares, [True] * len(gram))
    core = _core(everyone)
    if core is None:
        return everyone
    core_dots = [sum(value for value, inside in zip(row, core, strict=True) if inside) for row in gram]
    core_total = sum(dot for dot, inside in zip(core_dots, core, strict=True) if inside)
    return _cosines(core_dots, core_total, squares, core)


def _sum(rows: list[torch.Tensor]) -> torch.Tensor:
    """The rows added into one new vector, in place: stacking them first copied every update (5 of the 7 ms a
    ResNet-20 round of ten updates took)."""
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total


def _cosines(
    dots: list[float], total_sq: float, squares: list[float], inside: list[bool]
) -> list[float | None]:
    """Each row's cosine with a sum of rows, less the row itself where it is one of the summed, from the rows'
    dot products with the sum, the sum's squared norm and the rows' squared norms."""
    cosines: list[float | None] = []
    for dot, square, own in zip(dots, squares, inside, strict=True):
        if own:
            dot, reference_sq = dot - square, total_sq - 2.0 * dot + square
        else:
            reference_sq = total_sq
        denominator = math.sqrt(max(square, 0.0) * max(reference_sq, 0.0))
        cosines.append(dot / denominator if denominator > 0 and math.isfinite(denominator) else None)
    return cosines


def _in_order(update: FlatUpdate, like: FlatUpdate) -> torch.Tensor:
    """`update`'s vector with its tensors in `like`'s order (the same submodel sent in another order)."""
    if update.keys == like.keys:
        return update.vector
    where, offset = {}, 0
    for key, shape in zip(update.keys, update.shapes, strict=True):
        size = math.prod(shape)
        where[key] = (offset, size)
        offset += size
    return torch.cat([update.vector[a : a + n] for a, n in (where[key] for key in like.keys)])


def cut(values: list[float], spreads: float = SPREADS, past: Sequence[float] = ()) -> float | None:
    """The cosine below which an update of this cohort is refused (None: no consensus, nothing is). `past`: the
    submodel's median cosines of its earlier rounds, oldest first; the last CONSENSUS_ROUNDS - 1 count."""
    if not values:  # no update had a direction (all zero or non-finite): nothing to judge by
        return None
    centre = median(values)
    recent = [*list(past)[-(CONSENSUS_ROUNDS - 1) :], centre]
    if centre < CONSENSUS or median(recent) < CONSENSUS:
        return None
    spread = max(median(abs(c - centre) for c in values), MIN_SPREAD) * SMALL_COHORT_WIDENING.get(
        len(values), 1.0
    )
    return min(FLOOR, centre - spreads * spread)


def _outliers(
    judged: list[tuple[int, float]], probation: frozenset[int], past: Sequence[float] = ()
) -> dict[int, str] | None:
    """The refused of one cohort; None when it was not judged (no consensus this round or over its earlier
    rounds' medians `past`, or a majority would be refused)."""
    values = [c for _, c in judged]
    bound, strict = cut(values, past=past), cut(values, PROBATION_SPREADS, past)
    if bound is None or strict is None:
        return None
    centre = median(values)
    refused = {}
    for i, c in judged:
        limit = strict if i in probation else bound
        if c < limit:
            refused[i] = (
                f"update cosine {c:+.3f} with its cohort's core below {limit:+.3f} "
                f"(cohort of {len(values)}, median {centre:+.3f}{', on probation' if i in probation else ''})"
            )
    return refused if 2 * len(refused) < len(values) else None
