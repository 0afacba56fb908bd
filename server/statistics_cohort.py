"""BN running statistics judged against the cohort, channel by channel: in-range poisoning.

The screen in server/running_statistics.py refuses statistics far *larger* than the round's (x10 in rms). A
board can stay under it and still wreck the model: running variances x9, variances of 0 or 1e-30, or running
means shifted by 8 standard deviations, all with honest weights, took a FedAvg model to chance (issue 25). What
they share: every channel moves the same way, relative to what the other boards measured for that channel.

So each running variance is compared channel by channel with the round's per-channel median (over the results
that changed the tensor; nested submodels hold channel prefixes), and the *median over channels* of the log
ratio is judged: beyond ±log(variance_factor) the result is refused (both ways: x9 and 0 alike). Each running
mean is compared with the per-channel median mean in units of that channel's median standard deviation, and
the median over channels of |shift| beyond `mean_sigmas` refuses it. Medians over channels keep honest
non-IID boards in: one board's few classes move some channels a lot, not all of them one way. Needs at least
three results per tensor (with two, neither can be told from the attacker).

Which methods need it: all that aggregate uploaded running statistics. HeteroFL's static BN (sBN) does not
track them: its evaluation recomputes them on the server from calibration data (nestling/calibration.py), so
nothing a board uploads reaches them (docs/methods-decisions.md, "BN statistics from boards").
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from nestling.models.layers import is_running_variance
from nestling.server.running_statistics import MeasuredStatistics, UploadedStatistics

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


# Per variance key: (key, the judged results holding it, each one's median log ratio; the running mean's key,
# the results holding it, each one's median shift in standard deviations), as both paths below measure them.
Shifts = list[tuple[str, list[int], np.ndarray, str | None, list[int], np.ndarray]]
SEGMENT = 4096.0  # per-key offset that keeps each key's clipped values (|x| <= 1000) apart in one sort


def _segment_medians(values: np.ndarray, segments: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per row, the median of each contiguous column segment (values clipped to ±1000): one sort for all keys."""
    offsets = segments * SEGMENT
    ordered = np.sort(values + offsets, axis=1) - offsets
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    low, high = starts + (lengths - 1) // 2, starts + lengths // 2
    return (ordered[:, low] + ordered[:, high]) / 2  # rows x keys


def _fast_shifts(measured: Sequence[MeasuredStatistics], judged: list[int]) -> Shifts | None:
    """The usual round: every judged result of one layout, every tensor changed, every channel held. All keys
    at once: one stack, one median per statistic kind, one sort per kind (a key at a time cost ~1 ms a round
    on tinycnn, as much as the aggregation)."""
    first = measured[judged[0]]
    if first.values is None or first.bounds is None:
        return None
    rows: list[np.ndarray] = []
    for index in judged:
        seen = measured[index]
        if (
            seen.keys != first.keys
            or seen.bounds != first.bounds
            or seen.values is None
            or (seen.changed is not None and not all(seen.changed))
        ):
            return None
        rows.append(seen.values)
    where = dict(zip(first.keys, first.bounds, strict=True))
    pairs = [
        (key, _mean_partner(key))
        for key in first.keys
        if is_running_variance(key) and where[key][1] > where[key][0]
    ]
    if not pairs:
        return []
    matrix = np.stack(rows).astype(np.float64)
    if np.isnan(matrix).any():
        return None
    columns = [np.arange(*where[key]) for key, _ in pairs]
    variances = matrix[:, np.concatenate(columns)]
    centre = np.median(variances, axis=0)
    alive = centre > TINY
    segments = np.concatenate([np.full(len(c), k, dtype=np.float64) for k, c in enumerate(columns)])[alive]
    lengths = np.bincount(segments.astype(np.int64), minlength=len(pairs))
    held = lengths > 0
    if not held.any():
        return []
    ratios = np.clip(np.log(np.maximum(variances[:, alive], 0.0) / centre[alive]), -1e3, 1e3)
    kept_lengths = lengths[held]
    renumbered = np.cumsum(held)[segments.astype(np.int64)] - 1.0
    var_shifts = _segment_medians(ratios, renumbered, kept_lengths)
    with_means = [
        m is not None and m in where and where[m][1] - where[m][0] == where[k][1] - where[k][0]
        for k, m in pairs
    ]
    mean_shifts = None
    if all(with_means):
        means = matrix[:, np.concatenate([np.arange(*where[m]) for _, m in pairs if m is not None])]
        middle = np.median(means, axis=0)
        sigmas = np.minimum(np.abs(means[:, alive] - middle[alive]) / np.sqrt(centre[alive]), 1e3)
        mean_shifts = _segment_medians(sigmas, renumbered, kept_lengths)
    elif any(with_means):
        return None
    shifts: Shifts = []
    kept_pairs = [pair for pair, ok in zip(pairs, held.tolist(), strict=True) if ok]
    for column, (key, mean_key) in enumerate(kept_pairs):
        if mean_shifts is None:
            shifts.append((key, judged, var_shifts[:, column], None, [], np.zeros(0)))
        else:
            shifts.append((key, judged, var_shifts[:, column], mean_key, judged, mean_shifts[:, column]))
    return shifts


def _slow_shifts(by_key: dict[str, list[tuple[int, np.ndarray]]]) -> Shifts:
    """Key by key, over the results that changed each tensor (nested prefixes padded with NaN)."""
    shifts: Shifts = []
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
        var_shifts = _median_over_channels(np.clip(ratios, -1e3, 1e3))
        holders = [index for index, _ in rows]
        mean_key = _mean_partner(key)
        mean_rows = by_key.get(mean_key) if mean_key is not None else None
        if not mean_rows or len(mean_rows) < MIN_COHORT:
            shifts.append((key, holders, var_shifts, None, [], np.zeros(0)))
            continue
        means = _padded(mean_rows)
        width = min(means.shape[1], len(centre))
        scale = np.sqrt(centre[:width])
        usable = scale > math.sqrt(TINY)
        if not usable.any():
            shifts.append((key, holders, var_shifts, None, [], np.zeros(0)))
            continue
        middle = _median(means[:, :width], axis=0)
        sigmas = np.abs(means[:, :width][:, usable] - middle[usable]) / scale[usable]
        moved = _median_over_channels(np.minimum(sigmas, 1e3))
        shifts.append((key, holders, var_shifts, mean_key, [index for index, _ in mean_rows], moved))
    return shifts


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

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        shifts = _fast_shifts(measured, judged)
        if shifts is None:
            shifts = _slow_shifts(_rows(statistics, measured, judged))
    for key, holders, var_shifts, mean_key, mean_holders, moved in shifts:
        for index, shift in zip(holders, var_shifts.tolist(), strict=True):
            if math.isfinite(shift) and abs(shift) > limit:
                note(
                    index,
                    abs(shift) / limit,
                    f"BN running variance {key} {math.exp(shift):.3g}x the round's per-channel median "
                    f"(median over channels; allowed 1/{variance_factor:g}..{variance_factor:g})",
                )
        for index, shift in zip(mean_holders, moved.tolist(), strict=True):
            if math.isfinite(shift) and shift > mean_sigmas:
                note(
                    index,
                    shift / mean_sigmas,
                    f"BN running mean {mean_key} {shift:.3g} standard deviations from the round's per-channel "
                    f"median (median over channels; allowed {mean_sigmas:g})",
                )
    return {index: reason for index, (_, reason) in sorted(worst.items())}
