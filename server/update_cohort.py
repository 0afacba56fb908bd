"""The cohort update screen: an update far off its submodel cohort's direction is refused, on by default.

`server/screening.py`'s direction rule (`min_update_cosine`) is opt-in because an honest board of a skewed fleet
can point against the others. This screen judges each update against the other updates of its own submodel
(the same tensors and shapes) in the round, only in cohorts of at least COHORT_MIN, and refuses an update whose
cosine with the mean of the others (on the coordinates both touch, `direction_cosines`) is

* below FLOOR (it does not move the model the way the others do: a sign flip, label-flipped training and
  noise sit at -0.7..+0.05 against honest IID medians of +0.45..+0.75), and
* more than SPREADS robust deviations below the cohort's median cosine (the deviations' median, at least
  MIN_SPREAD each), and
* in a cohort whose median cosine is at least CONSENSUS, refusing at most a minority.

The spread is what keeps skewed fleets safe: on a Dirichlet fleet honest cosines are spread out (their median
absolute deviation is several times an IID round's), so the cut falls below every honest board. Measured on
digits, 10 boards, 20 rounds (docs/benchmarks.md, robustness section): the cut never reached an honest update
of an IID, Dirichlet(0.5) or Dirichlet(0.1) fleet. A method whose boards train different submodels is judged per
submodel, and a submodel with fewer than COHORT_MIN updates in the round is not judged (logged once a round).

It reads only what screening measured on arrival and never changes an update it does not refuse, so an honest
run that trips nothing is aggregated bit for bit as with the screen off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

from nestling.server.flat_updates import FlatUpdate

COHORT_MIN = 5  # fewer updates of one submodel in a round: not judged (one bad board among 4 sets the median)
FLOOR = 0.1  # an update must point less along the others than this to be refused
SPREADS = 8.0  # ... and be this many robust deviations below the cohort's median cosine
MIN_SPREAD = 0.05  # a deviation counts at least this (a few closely agreeing boards: the MAD is near 0)
CONSENSUS = 0.3  # below this median cosine a cohort has no common direction to defend

Signature = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass
class CohortVerdict:
    """Index -> reason for each refused update, and the cohorts too small to judge (submodel size -> count)."""

    refused: dict[int, str] = field(default_factory=dict)
    unjudged: dict[int, int] = field(default_factory=dict)


def signature(update: FlatUpdate) -> Signature:
    """Which submodel an update is of: its tensors and their shapes, whatever order they were sent in."""
    return tuple(sorted(zip(update.keys, update.shapes, strict=True)))


def cohort_outliers(updates: list[FlatUpdate], cosines: list[float | None]) -> CohortVerdict:
    """The refusals of one round, given each update's cosine with the mean of the others."""
    verdict = CohortVerdict()
    cohorts: dict[Signature, list[int]] = {}
    for i, update in enumerate(updates):
        cohorts.setdefault(signature(update), []).append(i)
    for members in cohorts.values():
        judged = [(i, c) for i in members if (c := cosines[i]) is not None]
        if len(judged) < COHORT_MIN:
            size = updates[members[0]].size.elements
            verdict.unjudged[size] = verdict.unjudged.get(size, 0) + len(members)
            continue
        verdict.refused.update(_outliers(judged))
    return verdict


def cut(values: list[float]) -> float | None:
    """The cosine below which an update of this cohort is refused (None: no consensus, nothing is)."""
    centre = median(values)
    if centre < CONSENSUS:
        return None
    spread = max(median(abs(c - centre) for c in values), MIN_SPREAD)
    return min(FLOOR, centre - SPREADS * spread)


def _outliers(judged: list[tuple[int, float]]) -> dict[int, str]:
    values = [c for _, c in judged]
    bound = cut(values)
    if bound is None:
        return {}
    centre = median(values)
    refused = {
        i: f"update cosine {c:+.3f} with its cohort's mean below {bound:+.3f} "
        f"(cohort of {len(values)}, median {centre:+.3f})"
        for i, c in judged
        if c < bound
    }
    return refused if 2 * len(refused) < len(values) else {}
