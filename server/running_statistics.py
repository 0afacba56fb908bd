"""BN running statistics of a round's results, judged by their values, not by their change.

Running means and variances are measured from data, not trained: a submodel no board has trained yet has them
leave their initial values (0 and 1) on its first update, a change 10-100x the round's trained updates, so they
stay out of an update's norm and direction (server/flat_updates.py). What a bad board can do with them is send
values that wreck every model evaluated with them (a running variance x 10^4 scales that layer's output down
100x). So each statistics tensor's rms value is compared with the same tensor of the round's other results, and
a negative variance or a value whose square overflows float32 is refused on its own.

Measuring is per round, not per result: the round's statistics of one layout are concatenated in one call and
their per-tensor sums of squares read off one float64 cumulative sum, a handful of C calls for the whole round
(a multi-tensor norm per result cost ~2 us a tensor, more than the rest of the screening on a small model).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors

from nestling.models.layers import is_running_variance

Shapes = tuple[tuple[int, ...], ...]
FLOAT32_NORM_LIMIT = math.sqrt(float(torch.finfo(torch.float32).max))  # the update norm's float32 range, too


@dataclass(frozen=True)
class UploadedStatistics:
    """A result's BN running statistics as uploaded (its tensors, not copies), in the result's key order."""

    keys: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]


NO_STATISTICS = UploadedStatistics((), ())


@dataclass(frozen=True)
class MeasuredStatistics:
    """Each statistics tensor's rms value, and what is wrong with them on their own (None: nothing)."""

    keys: tuple[str, ...]
    rms: tuple[float, ...]
    problem: str | None = None


class _Layout:
    """Positions of one layout's tensors in their concatenation: the end of each in the cumulative sum of
    squares (with a leading zero), the square root of each count, and every running variance's elements."""

    def __init__(self, keys: tuple[str, ...], shapes: Shapes) -> None:
        counts = [math.prod(shape) for shape in shapes]
        ends = list(accumulate(counts))
        self.size = ends[-1] if ends else 0
        self.ends = torch.tensor([0, *ends], dtype=torch.int64)  # in the sum padded with a leading zero
        self.roots = np.sqrt(np.maximum(np.asarray(counts, dtype=np.float64), 1.0))
        variances = [
            torch.arange(end - count, end)
            for key, count, end in zip(keys, counts, ends, strict=True)
            if is_running_variance(key) and count
        ]
        self.variances = torch.cat(variances) if variances else None


@lru_cache(maxsize=256)
def _layout(keys: tuple[str, ...], shapes: Shapes) -> _Layout:
    return _Layout(keys, shapes)


def measure(statistics: list[UploadedStatistics]) -> list[MeasuredStatistics]:
    """Every result's statistics measured, results of one layout together."""
    groups: dict[tuple[tuple[str, ...], tuple[torch.Size, ...]], list[int]] = {}
    for index, uploaded in enumerate(statistics):
        groups.setdefault((uploaded.keys, tuple([t.shape for t in uploaded.tensors])), []).append(index)
    measured = [MeasuredStatistics((), ())] * len(statistics)
    for (keys, shapes), members in groups.items():
        layout = _layout(keys, tuple(tuple(shape) for shape in shapes))
        if not keys or layout.size == 0:
            for index in members:
                measured[index] = MeasuredStatistics(keys, (0.0,) * len(keys))
            continue
        tensors = [t for index in members for t in statistics[index].tensors]
        values = _flatten_dense_tensors(tensors).view(len(members), layout.size)  # mixed dtypes promoted
        squares = values.to(torch.float64).square_().cumsum(1)
        running = torch.nn.functional.pad(squares, (1, 0)).index_select(1, layout.ends).numpy()
        rms = np.sqrt(np.abs(np.diff(running, axis=1))) / layout.roots
        in_range = [bool(ok) for ok in np.all(rms < FLOAT32_NORM_LIMIT, axis=1).reshape(-1)]  # False for NaN
        negative: list[bool] = (
            (values.index_select(1, layout.variances).amin(1) < 0).tolist()
            if layout.variances is not None
            else [False] * len(members)
        )
        for row, (index, values_rms) in enumerate(zip(members, rms.tolist(), strict=True)):
            problem = None
            if not in_range[row]:
                problem = _range_problem(keys, values_rms)
            elif negative[row]:
                problem = _negative_variance(keys, statistics[index].tensors)
            measured[index] = MeasuredStatistics(keys, tuple(values_rms), problem)
    return measured


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


def statistics_outliers(measured: list[MeasuredStatistics], factor: float) -> dict[int, str]:
    """Index -> reason for results whose statistics are far larger than the round's others' (results with a
    problem of their own are left out of the comparison).

    Compared tensor by tensor (the same key across results; nested submodels hold prefixes of it, whose rms
    differs from the whole tensor's by about the square root of the width ratio at most): a tensor's rms over
    factor x the median of the others' rms for that key refuses the result. A key only one result carries is
    not judged (nothing to compare with); the divergence guard still stands behind it."""
    by_key: dict[str, list[tuple[int, float]]] = {}
    for index, stats in enumerate(measured):
        if stats.problem is None:
            for key, value in zip(stats.keys, stats.rms, strict=True):
                by_key.setdefault(key, []).append((index, value))
    worst: dict[int, tuple[float, str]] = {}
    for key, values in by_key.items():
        if len(values) < 2:
            continue
        ordered = sorted(v for _, v in values)
        for index, mine in values:
            if mine <= factor * ordered[0]:  # within factor of every other: no median of others can refuse it
                continue
            typical = median_without(ordered, bisect_left(ordered, mine))
            ratio = mine / max(typical, 1e-12)
            if ratio > factor and ratio > worst.get(index, (0.0, ""))[0]:
                worst[index] = (
                    ratio,
                    f"BN running statistic {key} rms {mine:.3g} over {factor:g}x the round's median {typical:.3g}",
                )
    return {index: reason for index, (_, reason) in sorted(worst.items())}


def median_without(ordered: list[float], position: int) -> float:
    """The median of a sorted list without its element at `position`, in O(1)."""
    count = len(ordered) - 1

    def other(j: int) -> float:
        return ordered[j] if j < position else ordered[j + 1]

    middle = count // 2
    return other(middle) if count % 2 else 0.5 * (other(middle - 1) + other(middle))
