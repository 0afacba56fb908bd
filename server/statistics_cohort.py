"""BN running statistics judged against the cohort, channel by channel: in-range poisoning.

The screen in server/running_statistics.py refuses statistics far *larger* than the round's (x10 in standard
deviations). A board can stay under it and still wreck the model: running variances x9, variances of 0 or
1e-30, or running means shifted by 8 standard deviations, all with honest weights, took a FedAvg model to
chance (issue 25). What they share: every channel moves the same way, relative to what the other boards
measured for that channel.

So each running variance is compared channel by channel with the round's per-channel median (over the results
that changed the tensor; nested submodels hold channel prefixes), and the *median over channels* of the log
ratio is taken per tensor; a result is refused when the *median over its tensors* of those is beyond
±log(variance_factor) (both ways: x9 and 0 alike). Each running mean is compared with the per-channel median
mean in units of that channel's median standard deviation, and the same two medians beyond `mean_sigmas`
refuse it. Medians keep honest non-IID boards in: one board's few classes move some channels a lot, not all of
them one way, and some tensors (an honest DynamicFL board's deepest BN at 4.79x in its first round), not all.
Needs at least three results per tensor (with two, neither can be told from the attacker).

Bounds cannot stop statistics inside them (every variance x3.9 took FedAvg to chance), so this screen serves
`[run] bn_statistics = "mean"`, the papers' averaging; the default per-channel median (nestling/aggregation.py)
needs none, and the coordinator does not run it then (server/round_screen.py).

Which methods need it: all that aggregate uploaded running statistics. HeteroFL's static BN (sBN) does not
track them: its evaluation recomputes them on the server from calibration data (nestling/calibration.py), so
nothing a board uploads reaches them (docs/methods-decisions.md, "BN statistics from boards").
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from nestling.models.layers import is_running_variance
from nestling.server.running_statistics import MeasuredStatistics, UploadedStatistics, rows_together

MIN_COHORT = 3  # results changing a tensor before it is judged
TINY = 1e-12  # per-channel median variances at or below this are dead channels: not judged
DEFAULT_VARIANCE_FACTOR = 4.0
DEFAULT_MEAN_SIGMAS = 3.0


def _mean_partner(key: str) -> str | None:
    head, _, name = key.rpartition(".")
    if name == "running_var" or name.startswith("running_var_w"):
        return f"{head}.{name.replace('running_var', 'running_mean', 1)}"
    return None


def _rows(
    statistics: Sequence[UploadedStatistics], measured: Sequence[MeasuredStatistics], judged: list[int]
) -> dict[str, list[tuple[int, np.ndarray]]]:
    """Per key: (result index, its values) of the judged results that changed the tensor; read from the rows
    `measure` made when it has them, else converted tensor by tensor."""
    by_key: dict[str, list[tuple[int, np.ndarray]]] = {}
    for index in judged:
        seen = measured[index]
        changed, row, bounds = seen.changed, seen.values, seen.bounds
        if row is not None and bounds is not None:
            parts: Sequence[np.ndarray] = [row[start:end] for start, end in bounds]
        else:
            parts = [
                t.detach().reshape(-1).to(torch.float64).numpy() for t in statistics[index].tensor_list()
            ]
        for at, (key, values) in enumerate(zip(seen.keys, parts, strict=True)):
            if (changed is not None and not changed[at]) or key.endswith("num_batches_tracked"):
                continue
            by_key.setdefault(key, []).append((index, values))
    return by_key


def _padded(rows: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """Rows of unequal length (channel prefixes) as one matrix, NaN where a result does not hold a channel."""
    width = max(len(values) for _, values in rows)
    matrix = np.full((len(rows), width), np.nan)
    for i, (_, values) in enumerate(rows):
        matrix[i, : len(values)] = values
    return matrix


def _median(values: np.ndarray, axis: int) -> np.ndarray:
    """The median along `axis` over the values held (NaN: not held); numpy's nanmedian only where needed (it
    costs ~1 ms a call, np.median ~20 us)."""
    if not np.isnan(values).any():
        return np.median(values, axis=axis)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nothing held along a line: NaN, not judged
        return np.nanmedian(values, axis=axis)


def _median_over_channels(values: np.ndarray) -> np.ndarray:
    """Per row, the median over the channels that row has a judged value for (NaN: none)."""
    return _median(values, axis=1)


@dataclass(frozen=True)
class Shifts:
    """How far each judged result sits from the round, for one or more running variance keys (one column each):
    the median over channels of its log variance ratio (rows: `holders`) and of its mean shift in standard
    deviations (rows: `mean_holders`; no columns when the means are not judged)."""

    keys: tuple[str, ...]
    holders: list[int]
    variance: np.ndarray  # len(holders) x len(keys)
    mean_keys: tuple[str | None, ...]
    mean_holders: list[int]
    mean: np.ndarray  # len(mean_holders) x len(keys), or no columns


SEGMENT = 4096.0  # per-key offset that keeps each key's clipped values (|x| <= 1000) apart in one sort


class Segments:
    """Contiguous column segments, one per key (`lengths` columns each), laid out for `_segment_medians`: each
    column's offset and each segment's middle columns."""

    def __init__(self, numbers: np.ndarray, lengths: np.ndarray) -> None:
        self.offsets = numbers * SEGMENT
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        self.low, self.high = starts + (lengths - 1) // 2, starts + lengths // 2


def _segment_medians(values: np.ndarray, segments: Segments) -> np.ndarray:
    """Per row, the median of each contiguous column segment (values clipped to ±1000): one sort for all keys."""
    ordered = np.sort(values + segments.offsets, axis=1) - segments.offsets
    return (ordered[:, segments.low] + ordered[:, segments.high]) / 2  # rows x keys


class _Plan:
    """What the one-layout path reads of a statistics layout, worked out once per layout: the running variance
    keys (non-empty) and their means' keys, their columns in a result's row (variances, then means), and each
    variance column's key number (its segment) with each key's channel count."""

    def __init__(self, keys: tuple[str, ...], bounds: tuple[tuple[int, int], ...]) -> None:
        where = dict(zip(keys, bounds, strict=True))
        pairs = [(k, _mean_partner(k)) for k in keys if is_running_variance(k) and where[k][1] > where[k][0]]
        self.keys = tuple(k for k, _ in pairs)
        with_means = [
            m is not None and m in where and where[m][1] - where[m][0] == where[k][1] - where[k][0]
            for k, m in pairs
        ]
        self.with_means = bool(pairs) and all(with_means)
        self.mixed = any(with_means) and not self.with_means  # key by key then
        self.mean_keys = tuple(m for _, m in pairs) if self.with_means else ()
        variance_columns = [np.arange(*where[k]) for k in self.keys]
        columns = variance_columns + [np.arange(*where[m]) for m in self.mean_keys if m is not None]
        self.columns = np.concatenate(columns) if columns else np.zeros(0, dtype=np.int64)
        self.width = sum(len(c) for c in variance_columns)
        self.segments = (
            np.concatenate([np.full(len(c), k, dtype=np.float64) for k, c in enumerate(variance_columns)])
            if variance_columns
            else np.zeros(0)
        )
        self.lengths = np.asarray([len(c) for c in variance_columns], dtype=np.int64)
        self.every_channel = Segments(self.segments, self.lengths)  # the usual round: every channel alive
        self.starts = np.concatenate(([0], np.cumsum(self.lengths)[:-1])).astype(np.int64)


@lru_cache(maxsize=256)
def _plan(keys: tuple[str, ...], bounds: tuple[tuple[int, int], ...]) -> _Plan:
    return _Plan(keys, bounds)


MARGIN = 1.0 - 1e-6  # float32 rounding of the bounds below (a few ulps) never lets a refusal through


def _within_bounds(
    measured: Sequence[MeasuredStatistics], judged: list[int], variance_factor: float, mean_sigmas: float
) -> bool:
    """The honest round's certificate, from every channel's extremes over the results (no medians, no sort):
    in a channel whose largest running variance is within `variance_factor` of its smallest (alive), every
    result's variance is within that factor of the channel's median; and when its running means span less
    than `mean_sigmas` of the smallest standard deviation, every mean is within `mean_sigmas` of the median
    mean in the median's deviations. When more than half of every key's channels are such, every result's
    median over channels is within bounds: nobody can be refused. Else (or not one layout) False: judge."""
    rows = rows_together(measured, judged)
    first = measured[judged[0]]
    if rows is None or first.block is None or first.bounds is None:
        return False
    plan = _plan(first.keys, first.bounds)
    if plan.mixed or not plan.keys:
        return False
    block = first.block
    picked = (block if rows == list(range(len(block))) else block[rows])[:, plan.columns]
    high, low = picked.max(axis=0), picked.min(axis=0)
    width = plan.width
    smallest = low[:width]
    good = (high[:width] <= (variance_factor * MARGIN) * smallest) & (smallest > TINY)  # NaN: not good
    if plan.with_means:
        good &= high[width:] - low[width:] <= (mean_sigmas * MARGIN) * np.sqrt(smallest)
    return bool((2 * np.add.reduceat(good, plan.starts, dtype=np.int64) > plan.lengths).all())


def _fast_shifts(measured: Sequence[MeasuredStatistics], judged: list[int]) -> list[Shifts] | None:
    """The usual round: every judged result of one layout, measured together, every tensor changed, every
    channel held. All keys at once, from the matrix `measure` made: one gather, one sort for every channel's
    median, one sort for every key's median over channels (a key at a time cost ~1 ms a round on tinycnn, as
    much as the aggregation)."""
    rows = rows_together(measured, judged)
    first = measured[judged[0]]
    if rows is None or first.block is None or first.bounds is None:
        return None  # results of several layouts, or a tensor a board left as sent: key by key
    plan = _plan(first.keys, first.bounds)
    if plan.mixed:
        return None
    if not plan.keys:
        return []
    block = first.block
    whole = rows == list(range(len(block)))
    picked = (block if whole else block[rows])[:, plan.columns].astype(np.float64)
    if np.isnan(picked).any():
        return None
    count = len(rows)
    ordered = np.sort(picked, axis=0)  # every channel's median at once (np.median: ~150 us a call here)
    middle = (ordered[(count - 1) // 2] + ordered[count // 2]) / 2
    variances, centre = picked[:, : plan.width], middle[: plan.width]
    means, mean_middle = picked[:, plan.width :], middle[plan.width :]
    alive = centre > TINY
    if alive.all():
        segments, held = plan.every_channel, None
    else:  # dead channels (every board measured 0) are left out, and keys with none alive altogether
        numbers = plan.segments[alive]
        counts = np.bincount(numbers.astype(np.int64), minlength=len(plan.keys))
        held = counts > 0
        if not held.any():
            return []
        segments = Segments(np.cumsum(held)[numbers.astype(np.int64)] - 1.0, counts[held])
        variances, centre = variances[:, alive], centre[alive]
        if plan.with_means:
            means, mean_middle = means[:, alive], mean_middle[alive]
    ratios = np.clip(np.log(np.maximum(variances, 0.0) / centre), -1e3, 1e3)
    if plan.with_means:
        sigmas = np.minimum(np.abs(means - mean_middle) / np.sqrt(centre), 1e3)
        both = _segment_medians(np.concatenate([ratios, sigmas]), segments)
        var_shifts, mean_shifts = both[:count], both[count:]
    else:
        var_shifts, mean_shifts = _segment_medians(ratios, segments), np.zeros((0, 0))
    keys, mean_keys = plan.keys, plan.mean_keys
    if held is not None:
        keys = tuple(k for k, ok in zip(keys, held.tolist(), strict=True) if ok)
        mean_keys = tuple(m for m, ok in zip(mean_keys, held.tolist(), strict=True) if ok)
    if not plan.with_means:
        return [Shifts(keys, judged, var_shifts, (), [], mean_shifts)]
    return [Shifts(keys, judged, var_shifts, mean_keys, judged, mean_shifts)]


def _slow_shifts(by_key: dict[str, list[tuple[int, np.ndarray]]]) -> list[Shifts]:
    """Key by key, over the results that changed each tensor (nested prefixes padded with NaN)."""
    shifts: list[Shifts] = []
    for key, rows in by_key.items():
        if not is_running_variance(key) or len(rows) < MIN_COHORT:
            continue
        variances = _padded(rows)
        centre = _median(variances, axis=0)
        alive = centre > TINY
        if not alive.any():
            continue
        ratios = np.log(np.maximum(variances[:, alive], 0.0) / centre[alive])
        ratios = np.where(np.isnan(variances[:, alive]), np.nan, ratios)
        var_shifts = _median_over_channels(np.clip(ratios, -1e3, 1e3))[:, None]
        holders = [index for index, _ in rows]
        mean_key = _mean_partner(key)
        mean_rows = by_key.get(mean_key) if mean_key is not None else None
        unjudged = Shifts((key,), holders, var_shifts, (), [], np.zeros((0, 0)))
        if not mean_rows or len(mean_rows) < MIN_COHORT:
            shifts.append(unjudged)
            continue
        means = _padded(mean_rows)
        width = min(means.shape[1], len(centre))
        scale = np.sqrt(centre[:width])
        usable = scale > math.sqrt(TINY)
        if not usable.any():
            shifts.append(unjudged)
            continue
        middle = _median(means[:, :width], axis=0)
        sigmas = np.abs(means[:, :width][:, usable] - middle[usable]) / scale[usable]
        moved = _median_over_channels(np.minimum(sigmas, 1e3))[:, None]
        shifts.append(
            Shifts((key,), holders, var_shifts, (mean_key,), [index for index, _ in mean_rows], moved)
        )
    return shifts


def _factor(log_ratio: float) -> str:
    """A log ratio's factor for a reason (a zero variance's clipped 1000 would overflow)."""
    return f"{math.exp(log_ratio):.3g}" if log_ratio < 700 else "inf"


def _by_result(shifts: list[Shifts], means: bool) -> dict[int, tuple[float, int, str, float]]:
    """Per result: the median over its tensors of their shifts' sizes (|log ratio| for variances, sigmas for
    means: half the tensors x9 and half /9 are as far off as all x9), how many tensors, and its worst tensor
    with that tensor's shift."""
    found: dict[int, list[tuple[float, str]]] = {}
    for part in shifts:
        values = part.mean if means else part.variance
        keys = part.mean_keys if means else part.keys
        holders = part.mean_holders if means else part.holders
        if not values.size:
            continue
        for row, index in enumerate(holders):
            entry = found.setdefault(index, [])
            for column, key in enumerate(keys):
                value = float(values[row, column])
                if value == value and key is not None:  # NaN: no channel of it judged
                    entry.append((value, key))
    result = {}
    for index, entries in found.items():
        if entries:
            ranked = sorted(abs(value) for value, _ in entries)
            middle = (ranked[(len(ranked) - 1) // 2] + ranked[len(ranked) // 2]) / 2
            worst, key = max(entries, key=lambda entry: abs(entry[0]))
            result[index] = (middle, len(entries), key, worst)
    return result


def cohort_outliers(
    statistics: Sequence[UploadedStatistics],
    measured: Sequence[MeasuredStatistics],
    variance_factor: float = DEFAULT_VARIANCE_FACTOR,
    mean_sigmas: float = DEFAULT_MEAN_SIGMAS,
) -> dict[int, str]:
    """Index -> reason for results whose running variances or means sit, channel for channel, outside the
    round's cohort (results with a problem of their own are left out)."""
    judged = [i for i, m in enumerate(measured) if m.problem is None]
    if len(judged) < MIN_COHORT:
        return {}
    limit = math.log(variance_factor)
    worst: dict[int, tuple[float, str]] = {}

    def note(index: int, badness: float, reason: str) -> None:
        if badness > worst.get(index, (0.0, ""))[0]:
            worst[index] = (badness, reason)

    # A judged tensor's rms is under 1.8e19, so each value is under that times the root of its size: far from
    # float32's 3.4e38 even times the factor. The certificate cannot overflow, and needs no error state.
    if _within_bounds(measured, judged, variance_factor, mean_sigmas):
        return {}
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        shifts = _fast_shifts(measured, judged)
        if shifts is None:
            shifts = _slow_shifts(_rows(statistics, measured, judged))
    # A result is refused when the median over its tensors is out of bounds, not its worst tensor: an attack moves
    # every tensor one way, an honest board's data moves some. DynamicFL's preset, round 0: an honest board's
    # deepest BN at 4.79x the round's (its others 1.05-3.36x, their median 1.5x).
    for index, (moved, count, key, shift) in _by_result(shifts, means=False).items():
        if moved > limit:
            note(
                index,
                moved / limit,
                f"BN running variance {key} {math.exp(shift):.3g}x the round's per-channel median (median "
                f"over channels; its {count} running variances' median ratio {_factor(moved)}x or "
                f"1/{_factor(moved)}, allowed 1/{variance_factor:g}..{variance_factor:g})",
            )
    for index, (moved, count, key, shift) in _by_result(shifts, means=True).items():
        if moved > mean_sigmas:
            note(
                index,
                moved / mean_sigmas,
                f"BN running mean {key} {shift:.3g} standard deviations from the round's per-channel median "
                f"(median over channels; its {count} running means' median {moved:.3g}, allowed {mean_sigmas:g})",
            )
    return {index: reason for index, (_, reason) in sorted(worst.items())}
