"""One round's screens, between collecting results and aggregating them: what the coordinator refuses, clips
and bounds of the results it accepted (server/screening.py, running_statistics.py, statistics_cohort.py,
influence.py hold the rules; this module applies them in order and counts and logs what they did)."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median

from nestling.messages import Result, Task
from nestling.server.influence import bound_influence
from nestling.server.refusals import RefusalLog
from nestling.server.running_statistics import measure as measure_statistics
from nestling.server.running_statistics import statistics_outliers
from nestling.server.screening import (
    FlatUpdate,
    GlobalLayout,
    RobustPolicy,
    UpdateWorkspace,
    absolute_reason,
    clip_update,
    direction_cosines,
    direction_outliers,
    screen_norms,
    update_size,
)
from nestling.server.statistics_cohort import cohort_outliers
from nestling.server.strikes import StrikeRecord
from nestling.server.update_cohort import COHORT_MIN
from nestling.server.update_cohort import cohort_outliers as update_cohort_outliers

log = logging.getLogger("nestling.coordinator")

Pairs = list[tuple[Task, Result]]


@dataclass
class RoundScreen:
    """What the screens read of the coordinator for one round: its policy and refusal log, the updates measured
    on arrival (task id -> update; packed results are measured here), the devices whose tensors were non-finite
    (the divergence guard reads them), the largest recent round median update rms, the global layout, and the
    sample counts the round's available devices registered."""

    robust: RobustPolicy
    refusals: RefusalLog
    workspace: UpdateWorkspace
    updates: dict[str, FlatUpdate]
    non_finite: set[str]
    recent: float | None
    layout: Callable[[], GlobalLayout]
    cohort: list[int]
    strikes: StrikeRecord
    # Each submodel's median cosine in the cohort screen's earlier rounds (`update_cohort.cohort_key` -> oldest
    # first): a cohort is judged only when they agree as well as this round's
    consensus: dict[str, list[float]] = field(default_factory=dict)
    # What the cohort screen judged this round (device ids, for the round's record) and who it set aside
    # (device -> first round it may be selected again).
    judged: list[str] = field(default_factory=list)
    struck: list[str] = field(default_factory=list)
    aside: dict[str, int] = field(default_factory=dict)
    medians: dict[str, float] = field(default_factory=dict)  # this round's, per submodel cohort

    def run(self, round_index: int, accepted: Pairs, counters: Counter[str]) -> tuple[Pairs, float | None]:
        """Refuse updates far outside the round's distribution (their trained weights' size and, when enabled,
        direction; their BN running statistics' values), bound each result's weight, then clip if configured.
        Also returns the round's median update rms (None: nothing screened)."""
        robust = self.robust
        round_rms = None
        softened: dict[str, float] = {}  # task id -> the norm its update was clipped to above
        if robust.screen_updates and accepted:
            accepted = self._measure_waiting(round_index, accepted, counters)
        if robust.screen_updates and accepted:
            accepted, round_rms = self._screen_sizes(round_index, accepted, counters, softened)
        directions = robust.min_update_cosine > -1.0 and len(accepted) >= 3
        # a board on probation is judged (or, in too small a round, not taken) whatever the round's size
        cohorts = robust.cohort_screen and (
            len(accepted) >= COHORT_MIN or any(self.strikes.on_probation(r.device_id) for _, r in accepted)
        )
        if robust.screen_updates and (directions or cohorts):
            accepted = self._screen_directions(round_index, accepted, counters, directions)
        bounded = bound_influence(accepted, self.cohort, robust.max_sample_factor, robust.max_weight_share)
        for _, kept, why in bounded.changed.values():
            counters["bounded_num_samples"] += 1
            log.info("round %d: a result's weight bounded to %d samples: %s", round_index, kept, why)
        accepted = bounded.accepted
        if robust.clip_update_norm is not None:
            bound = robust.clip_update_norm
            clipped = []
            for task, result in accepted:
                known = self.updates.get(result.task_id)
                norm = softened.get(result.task_id)
                if norm is None:
                    norm = known.size.norm if known is not None else update_size(task, result).norm
                if norm > bound:
                    counters["clipped"] += 1
                clipped.append((task, clip_update(task, result, norm, bound)))
            accepted = clipped
        return accepted, round_rms

    def _screen_directions(
        self, round_index: int, accepted: Pairs, counters: Counter[str], directions: bool
    ) -> Pairs:
        """The round-wide direction rule when enabled (cosines with the mean of the others), and the cohort
        screen (server/update_cohort.py: cosines with the cohort's coordinate-wise median)."""
        updates = [self.updates[r.task_id] for _, r in accepted]
        turned: dict[int, tuple[str, str]] = {}
        if directions:  # the operator's explicit rule names what both find
            cosines = direction_cosines(updates, self.layout(), self.workspace)
            for index, why in direction_outliers(cosines, self.robust).items():
                turned[index] = ("rejected_update_direction", why)
        if self.robust.cohort_screen:
            probation = frozenset(
                i for i, (_, result) in enumerate(accepted) if self.strikes.on_probation(result.device_id)
            )
            verdict = update_cohort_outliers(updates, probation, self.workspace, self.consensus)
            self.medians = verdict.medians
            for index, why in verdict.refused.items():
                turned.setdefault(index, ("rejected_update_cohort", why))
            self.judged = sorted(accepted[i][1].device_id for i in verdict.judged)
            self.struck = sorted(accepted[i][1].device_id for i in verdict.refused)
            self.aside = self.strikes.judge(round_index, self.judged, set(self.struck))
            if verdict.unjudged:
                log.debug(
                    "round %d: cohort screen skipped submodels with too few updates (elements: updates) %s",
                    round_index,
                    verdict.unjudged,
                )
        for index, (counter, why) in sorted(turned.items()):
            self.refusals.refuse(round_index, accepted[index][1].device_id, counter, why)
            counters[counter] += 1
        return [pair for i, pair in enumerate(accepted) if i not in turned]

    def _screen_sizes(
        self, round_index: int, accepted: Pairs, counters: Counter[str], softened: dict[str, float]
    ) -> tuple[Pairs, float | None]:
        """The norm screens and the BN statistics screens (on their own, x10 the round's; with the papers' mean
        of BN statistics, the cohort's)."""
        robust = self.robust
        accepted = list(accepted)  # soft clipping replaces entries: not in the caller's list
        updates = [self.updates[r.task_id] for _, r in accepted]
        sizes = [u.size for u in updates]
        statistics = measure_statistics([u.statistics for u in updates])
        refused = {i: m.problem for i, m in enumerate(statistics) if m.problem is not None}
        too_large, bounds = screen_norms(sizes, robust, self.recent)
        judged = [too_large, statistics_outliers(statistics, robust.update_norm_factor)]
        # A per-channel median of BN statistics needs no in-range screen: one board's lie moves it a rank at most.
        if robust.bn_statistics == "mean":
            judged.append(
                cohort_outliers(
                    [u.statistics for u in updates],
                    statistics,
                    robust.bn_variance_factor,
                    robust.bn_mean_sigmas,
                )
            )
        for found in judged:
            for index, reason in found.items():
                refused.setdefault(index, reason)
        for index, reason in sorted(refused.items()):
            device_id = accepted[index][1].device_id
            self.refusals.refuse(round_index, device_id, "rejected_update_norm", reason)
            counters["rejected_update_norm"] += 1
        for index, bound in bounds.items():
            if index not in refused:
                task, result = accepted[index]
                accepted[index] = (task, clip_update(task, result, sizes[index].norm, bound))
                softened[result.task_id] = bound
                counters["clipped_update_norm"] += 1
                log.info(
                    "round %d: %s's update (rms %.3g) clipped to %gx the round's median",
                    round_index,
                    result.device_id,
                    sizes[index].rms,
                    robust.update_norm_factor,
                )
        kept = [size.rms for i, size in enumerate(sizes) if i not in refused and math.isfinite(size.rms)]
        return [pair for i, pair in enumerate(accepted) if i not in refused], median(kept) if kept else None

    def _measure_waiting(self, round_index: int, accepted: Pairs, counters: Counter[str]) -> Pairs:
        """Measure the updates left for the round (packed results), together; refuse the non-finite ones."""
        waiting = [(task, result) for task, result in accepted if result.task_id not in self.updates]
        if not waiting:
            return accepted
        refused: set[str] = set()
        # the cohort screen will compare them: measured with their Gram matrix (norms from its diagonal)
        gram = self.robust.cohort_screen and len(waiting) >= COHORT_MIN
        for (_, result), update in zip(waiting, self.workspace.flat_updates(waiting, gram), strict=True):
            reason = absolute_reason(update.size, self.robust)
            if reason is None:
                self.updates[result.task_id] = update
                continue
            self.workspace.release(update)
            if not math.isfinite(update.size.norm):
                self.non_finite.add(result.device_id)
            self.refusals.refuse(round_index, result.device_id, "rejected_update_norm", reason)
            counters["rejected_update_norm"] += 1
            refused.add(result.task_id)
        return [pair for pair in accepted if pair[1].task_id not in refused]
