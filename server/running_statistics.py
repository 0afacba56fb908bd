"""BN running statistics of a round's results, judged by their values, not by their change.

Running means and variances are measured from data, not trained: a submodel no board has trained yet has them
leave their initial values (0 and 1) on its first update, a change 10-100x the round's trained updates, so they
stay out of an update's norm and direction (server/flat_updates.py). What a bad board can do with them is send
values that wreck every model evaluated with them (a running variance x 10^4 scales that layer's output down
100x). So each statistics tensor's rms value is compared with the same tensor of the round's other results, in
the layer's units (a variance by its square root, a mean against the layer's standard deviation), and a negative
variance or a value whose square overflows float32 is refused on its own.

Measuring is per round, not per result: the round's statistics of one layout are concatenated in one call and
their per-tensor sums of squares read off one float64 cumulative sum, a handful of C calls for the whole round
(a multi-tensor norm per result cost ~2 us a tensor, more than the rest of the screening on a small model).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from statistics import median
from typing import NamedTuple

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors

from nestling.models.layers import is_running_variance
from nestling.packed import views_of

Shapes = tuple[tuple[int, ...], ...]
FLOAT32_NORM_LIMIT = math.sqrt(float(torch.finfo(torch.float32).max))  # the update norm's float32 range, too


class UploadedStatistics(NamedTuple):
    """A result's BN running statistics as uploaded (its tensors, not copies), in the result's key order.

    A packed result (nestling/packed.py) also hands them over as one vector, `flat`, in `keys` order, with
    their `shapes`: the round's statistics are then one stack, not a concatenation of every tensor."""

    keys: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...] = ()  # empty when `flat` holds them
    flat: torch.Tensor | None = None
    shapes: Shapes | None = None
    layout: object = None  # an interned object standing for (keys, shapes): grouping by it hashes nothing big
    # What the task sent for the same keys (tensors, or one vector beside `flat`): a tensor the board left as sent
    # (FjORD's statistics of widths it did not train) is no evidence about the round's values. Empty: unknown.
    sent: tuple[torch.Tensor, ...] = ()
    sent_flat: torch.Tensor | None = None

    def tensor_list(self) -> tuple[torch.Tensor, ...]:
        """Each statistics tensor (views of `flat` for a packed result)."""
        if self.flat is None or self.shapes is None:
            return self.tensors
        return tuple(views_of(self.flat, self.shapes))

    @property
    def signature(self) -> tuple[tuple[str, ...], Shapes]:
        """What results measured together share: keys and shapes."""
        shapes = self.shapes if self.shapes is not None else tuple(tuple(t.shape) for t in self.tensors)
        return self.keys, shapes


NO_STATISTICS = UploadedStatistics((), ())


@dataclass(slots=True)  # not frozen: its constructor is 3x faster (ten a round); nothing changes one
class MeasuredStatistics:
    """Each statistics tensor's rms value, and what is wrong with them on their own (None: nothing)."""

    keys: tuple[str, ...]
    rms: tuple[float, ...]
    problem: str | None = None
    changed: tuple[bool, ...] | None = (
        None  # which tensors differ from what the task sent (None: all, unknown)
    )
    # Where each tensor sits in a result's row of values, the matrix of every result measured together with
    # this one (one layout; the cohort screen, server/statistics_cohort.py, reads it without converting any
    # tensor), this result's row in it, and the rms of every tensor of those results (rows alike).
    bounds: tuple[tuple[int, int], ...] | None = field(default=None, compare=False, repr=False)
    block: np.ndarray | None = field(default=None, compare=False, repr=False)
    row: int = field(default=0, compare=False, repr=False)
    rms_block: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def values(self) -> np.ndarray | None:
        """The values themselves, as measured (this result's row of `block`)."""
        return None if self.block is None else self.block[self.row]

    def compared(self) -> list[tuple[str, float]]:
        """(key, rms) of the tensors the round's comparison judges: those the board changed."""
        if self.changed is None:
            return list(zip(self.keys, self.rms, strict=True))
        return [(k, v) for k, v, c in zip(self.keys, self.rms, self.changed, strict=True) if c]


class _Layout:
    """Where each tensor of one layout sits in their concatenation (the start of each non-empty one, for one
    reduceat), the square root of each count, and every running variance's elements."""

    def __init__(self, keys: tuple[str, ...], shapes: Shapes) -> None:
        counts = np.asarray([math.prod(shape) for shape in shapes], dtype=np.int64)
        ends = np.cumsum(counts)
        self.size = int(ends[-1]) if len(ends) else 0
        self.nonempty = counts > 0
        self.all_nonempty = bool(self.nonempty.all())
        self.starts = (ends - counts)[self.nonempty]
        self.bounds = tuple(zip((ends - counts).tolist(), ends.tolist(), strict=True))
        self.roots = np.sqrt(np.maximum(counts.astype(np.float64), 1.0))
        variances = [
            np.arange(end - count, end)
            for key, count, end in zip(keys, counts.tolist(), ends.tolist(), strict=True)
            if is_running_variance(key) and count
        ]
        self.variances: np.ndarray | slice | None = None
        if variances:
            indices = np.concatenate(variances)  # ascending
            trailing = int(indices[0]) + len(indices) == self.size == int(indices[-1]) + 1
            # a trailing block (packed results keep variances last) is read as a view, not gathered
            self.variances = slice(int(indices[0]), None) if trailing else indices


@lru_cache(maxsize=256)
def _layout(keys: tuple[str, ...], shapes: Shapes) -> _Layout:
    return _Layout(keys, shapes)


def measure(statistics: list[UploadedStatistics]) -> list[MeasuredStatistics]:
    """Every result's statistics measured, results of one layout together (a handful of numpy calls)."""
    groups: dict[object, list[int]] = {}
    for index, uploaded in enumerate(statistics):
        groups.setdefault(uploaded.layout or uploaded.signature, []).append(index)
    measured = [MeasuredStatistics((), ())] * len(statistics)
    for members in groups.values():
        keys, shapes = statistics[members[0]].signature
        layout = _layout(keys, shapes)
        if not keys or layout.size == 0:
            for index in members:
                measured[index] = MeasuredStatistics(keys, (0.0,) * len(keys))
            continue
        count = len(members)
        # The task's values ride in the same pass: a tensor whose sum of squares equals what the task sent is
        # one the board left alone (it cannot be larger than the server's own values, so it is no evidence).
        with_sent = all(statistics[i].sent or statistics[i].sent_flat is not None for i in members)
        parts = [t for i in members for t in _parts(statistics[i])]
        if with_sent:
            parts += [t for i in members for t in _sent_parts(statistics[i])]
        if len(parts) == 1:
            flat = parts[0]
        elif all(part.dim() == 1 for part in parts):  # packed results: a plain cat (flattening costs 5x more)
            flat = torch.cat(parts)  # mixed dtypes promoted
        else:
            flat = _flatten_dense_tensors(parts)  # mixed dtypes promoted
        if flat.dtype not in (torch.float32, torch.float64):
            flat = flat.float()
        both = flat.numpy().reshape(-1, layout.size)
        values = both[:count]
        squares = np.square(both, dtype=np.float64)  # float32 values squared without overflow
        if layout.all_nonempty:
            sums = np.add.reduceat(squares, layout.starts, axis=1)
        else:
            sums = np.zeros((len(both), len(keys)))
            sums[:, layout.nonempty] = np.add.reduceat(squares, layout.starts, axis=1)
        rms_matrix = np.sqrt(sums[:count]) / layout.roots
        rms_rows = rms_matrix.tolist()
        changed = (sums[:count] != sums[count:]).tolist() if with_sent and len(both) == 2 * count else None
        # Each row's range and sign checks, skipped when the whole block passes them (one call each): the
        # honest round (NaN fails `<`, so a non-finite block is looked at row by row)
        in_range = (
            [True] * count
            if rms_matrix.max() < FLOAT32_NORM_LIMIT
            else np.all(rms_matrix < FLOAT32_NORM_LIMIT, axis=1).tolist()
        )
        variances = values[:, layout.variances] if layout.variances is not None else None
        lowest = (
            [0.0] * count
            if variances is None or variances.min() >= 0  # NaN anywhere: row by row
            else variances.min(axis=1).tolist()
        )
        for row, (index, rms, low, fits) in enumerate(zip(members, rms_rows, lowest, in_range, strict=True)):
            problem = None
            if not fits:
                problem = _range_problem(keys, rms)
            elif low < 0:
                problem = _negative_variance(keys, statistics[index].tensor_list())
            measured[index] = MeasuredStatistics(
                keys,
                tuple(rms),
                problem,
                None if changed is None else tuple(changed[row]),
                layout.bounds,
                values,
                row,
                rms_matrix,
            )
    return measured


def _parts(uploaded: UploadedStatistics) -> tuple[torch.Tensor, ...]:
    return (uploaded.flat,) if uploaded.flat is not None else uploaded.tensors


def _sent_parts(uploaded: UploadedStatistics) -> tuple[torch.Tensor, ...]:
    return (uploaded.sent_flat,) if uploaded.sent_flat is not None else uploaded.sent


def _range_problem(keys: tuple[str, ...], rms: list[float]) -> str:
    for key, value in zip(keys, rms, strict=True):
        if math.isnan(value) or math.isinf(value):
            return f"non-finite BN running statistic {key}"
        if value >= FLOAT32_NORM_LIMIT:
            return f"BN running statistic {key} beyond float32 range when squared (rms {value:.3g})"
    raise AssertionError("a row out of range has a key out of range")


def _negative_variance(keys: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> str:
    worst = next(
        k for k, t in zip(keys, tensors, strict=True) if is_running_variance(k) and float(t.min()) < 0
    )
    return f"negative BN running variance in {worst}"


REFERENCE_QUANTILE = (
    0.75  # the share of the others an outsized value is measured against (see `quantile_without`)
)


def statistics_outliers(measured: list[MeasuredStatistics], factor: float) -> dict[int, str]:
    """Index -> reason for results whose statistics are far larger than the round's others' (results with a
    problem of their own are left out of the comparison).

    Compared tensor by tensor (the same key across results; nested submodels hold prefixes of it, whose rms
    differs from the whole tensor's by about the square root of the width ratio at most), in the layer's units:
    a tensor over factor x the upper quartile of the others' for that key refuses the result (the update
    screen's rule, server/screening.py). A running variance is compared by the square root of its rms, a
    standard deviation: an honest non-IID board's activations can run a few times wider than the others' (a
    DynamicFL board of the CIFAR-10 Dirichlet(0.5) preset sent a variance 12x the others' in round 1, 3.5x in
    standard deviations), and compared as a variance the factor of 10 allowed only 3.2x. What the rule is for,
    values that wreck a model outright (x 10^4), is still 100x over. Only tensors a board changed take part:
    FjORD's boards send the statistics of widths they did not train as their task had them (0 and 1 until some
    board trains that width), which would set the reference at 0. A running mean's reference is at least the
    square root of the round's median rms of the matching running variance (honest means sit within a few
    standard deviations of 0, and near 0 their ratios mean nothing: FjORD's honest means differed 10x). A key
    only one result changed is not judged (nothing to compare with); the divergence guard still stands behind
    it."""
    judged = [index for index, stats in enumerate(measured) if stats.problem is None]
    if not judged:
        return {}
    if _all_within(measured, judged, factor):
        return {}
    by_key, every = _by_key(measured, judged)
    worst: dict[int, tuple[float, str]] = {}
    for key, values in by_key.items():
        if len(values) < 2:
            continue
        variance = is_running_variance(key)
        if variance:  # in standard deviations
            values = [(index, math.sqrt(value)) for index, value in values]
        ordered = sorted(v for _, v in values)
        if (
            ordered[-1] <= factor * ordered[0]
        ):  # all within factor of each other (an honest round): none refused
            continue
        variance_key = _variance_of(key)
        variances = every.get(variance_key) if variance_key is not None else None
        floor = math.sqrt(median(variances)) if variances else 0.0
        for index, mine in values:
            if mine <= factor * max(ordered[0], floor):  # within factor of every other: cannot be refused
                continue
            typical = max(quantile_without(ordered, bisect_left(ordered, mine), REFERENCE_QUANTILE), floor)
            ratio = mine / max(typical, 1e-12)
            if ratio > factor and ratio > worst.get(index, (0.0, ""))[0]:
                worst[index] = (ratio, _outlier_reason(key, mine, typical, ratio, factor, variance))
    return {index: reason for index, (_, reason) in sorted(worst.items())}


def _outlier_reason(
    key: str, mine: float, typical: float, ratio: float, factor: float, variance: bool
) -> str:
    """Why a statistic was refused, in the units it was judged in (a variance's rms is its square)."""
    if variance:
        return (
            f"BN running statistic {key} rms {mine**2:.3g} against the round's reference {typical**2:.3g}: "
            f"{ratio:.3g}x in standard deviations, over {factor:g}x"
        )
    return f"BN running statistic {key} rms {mine:.3g} over {factor:g}x the round's reference {typical:.3g}"


def rows_together(measured: Sequence[MeasuredStatistics], judged: list[int]) -> list[int] | None:
    """The rows of the judged results in their common block when they were all measured together (one layout)
    and the boards changed every tensor: the usual round, which the screens read as one matrix; else None."""
    block = measured[judged[0]].block
    if block is None:
        return None
    for index in judged:
        seen = measured[index]
        if seen.block is not block or (seen.changed is not None and not all(seen.changed)):
            return None
    return [measured[index].row for index in judged]


def _all_within(measured: list[MeasuredStatistics], judged: list[int], factor: float) -> bool:
    """The honest round's shortcut: every judged result measured together, all their tensors changed, and each
    tensor's rms within `factor` of every other result's (then nobody can be refused), in three numpy calls."""
    rows = rows_together(measured, judged)
    block = measured[judged[0]].rms_block
    if rows is None or block is None:
        return False
    rms = block if rows == list(range(len(block))) else block[rows]
    return bool(
        (rms.max(axis=0) <= _column_factors(measured[judged[0]].keys, factor) * rms.min(axis=0)).all()
    )


@lru_cache(maxsize=64)
def _column_factors(keys: tuple[str, ...], factor: float) -> np.ndarray:
    """Per statistics tensor, the bound on the ratio of two rms values: factor, squared for a variance (whose
    rms is a standard deviation's square)."""
    return np.array([factor**2 if is_running_variance(key) else factor for key in keys])


def _by_key(
    measured: list[MeasuredStatistics], judged: list[int]
) -> tuple[dict[str, list[tuple[int, float]]], dict[str, Sequence[float]]]:
    """Per key: (index, rms) of the judged results that changed it, and every judged result's rms (the floors)."""
    keys = measured[judged[0]].keys
    if all(measured[i].keys == keys for i in judged):  # the usual round: one layout, read column by column
        columns = list(zip(*(measured[i].rms for i in judged), strict=True)) if keys else []
        changes = [measured[i].changed for i in judged]
        every: dict[str, Sequence[float]] = dict(zip(keys, columns, strict=True))
        in_columns = {
            key: [
                (index, value)
                for index, value, change in zip(judged, column, changes, strict=True)
                if change is None or change[at]
            ]
            for at, (key, column) in enumerate(zip(keys, columns, strict=True))
        }
        return in_columns, every
    by_key: dict[str, list[tuple[int, float]]] = {}
    listed: dict[str, list[float]] = {}
    for index in judged:
        stats = measured[index]
        for key, value in zip(stats.keys, stats.rms, strict=True):
            listed.setdefault(key, []).append(value)
        for key, value in stats.compared():
            by_key.setdefault(key, []).append((index, value))
    return by_key, dict(listed)


@lru_cache(maxsize=4096)
def _variance_of(key: str) -> str | None:
    """The running variance beside a running mean (`x.running_mean` -> `x.running_var`, per width alike)."""
    head, _, name = key.rpartition(".")
    if name == "running_mean" or name.startswith("running_mean_w"):
        return f"{head}.{name.replace('running_mean', 'running_var', 1)}"
    return None


def quantile_without(ordered: list[float], position: int | None, q: float) -> float:
    """The q-quantile (linear interpolation) of a sorted list without its element at `position` (None: of the
    whole list), in O(1).

    The screens measure an outsized value against the others' upper quartile, not their median: honest rounds
    can be bimodal (DynamicFL's capacity tiers: updates of 3e-5 and 2.6e-3 rms in one round of four boards), and
    the median then sits in the lower mode. A single attacker among four or more results never sets the upper
    quartile of the others alone."""
    count = len(ordered) - (position is not None)

    def other(j: int) -> float:
        return ordered[j] if position is None or j < position else ordered[j + 1]

    at = q * (count - 1)
    low = math.floor(at)
    if low >= count - 1:
        return other(count - 1)
    return other(low) + (at - low) * (other(low + 1) - other(low))
