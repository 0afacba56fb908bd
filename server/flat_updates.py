"""Results' updates (result − task weights) as flat float32 vectors: what update screening measures and compares.

BN running statistics are not part of the vector: they are measured from data, not trained, and a submodel
no board has trained yet has its statistics leave their initial values on its first update, a change far larger
than any trained weight's. They travel beside it, judged by their values (server/running_statistics.py).

`flat_update` builds one on its own; `UpdateWorkspace` builds a round's updates into rows of a matrix kept from
round to round. On a small model the cost is per-tensor calls (a tinycnn result is 34 tensors of 5,268 values in
all), on a large one fresh allocations (every new megabyte-sized vector is page-faulted in): the workspace writes
each update with two multi-tensor C++ calls into a reused row, and lets the direction screen read a whole round
with two matrix-vector products. A packed result against its packed task (nestling/packed.py: one buffer each,
trained tensors first) needs no per-tensor call at all: one subtraction of the two buffers' trained parts, and
`flat_updates` writes a whole round of them with one stack, one multi-tensor subtraction and one norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from operator import itemgetter
from typing import NamedTuple

import numpy as np
import torch

from nestling.errors import SpecError
from nestling.messages import Result, Task
from nestling.models.layers import is_running_statistic
from nestling.packed import PackLayout, packing, views_of
from nestling.server.running_statistics import NO_STATISTICS, UploadedStatistics

Shapes = tuple[tuple[int, ...], ...]
Tensors = list[torch.Tensor] | tuple[torch.Tensor, ...]


class UpdateSize(NamedTuple):
    """An update's L2 norm and element count; rms compares submodels of different sizes fairly.

    The screens' small values are named tuples: a round makes three per result, and a frozen dataclass's
    constructor (one object.__setattr__ per field) cost ~6 us a result hot, several times that in a round."""

    norm: float
    elements: int

    @property
    def rms(self) -> float:
        return self.norm / math.sqrt(max(self.elements, 1))


class FlatUpdate(NamedTuple):
    """One result's update as a flat float32 vector over the trained floating tensors it shares with its task
    (BN running statistics apart, in `statistics`), in `keys` order, with its size. The vector is what the
    norm and direction screens measure."""

    keys: tuple[str, ...]
    shapes: Shapes
    vector: torch.Tensor
    size: UpdateSize
    statistics: UploadedStatistics = NO_STATISTICS


EMPTY = FlatUpdate((), (), torch.zeros(0), UpdateSize(0.0, 0))


def split_keys(
    weights: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]
) -> tuple[tuple[str, ...], ...]:
    """The floating keys a result shares with its task: (trained, running statistics), in the result's order."""
    shared = [k for k, v in weights.items() if k in sent and v.is_floating_point()]
    return (
        tuple(k for k in shared if not is_running_statistic(k)),
        tuple(k for k in shared if is_running_statistic(k)),
    )


def _fill(row: torch.Tensor, views: list[torch.Tensor], trained: Tensors, sent: Tensors) -> UpdateSize:
    """Write result − task into a float32 row through its views; its norm, inf when non-finite.

    Two multi-tensor C++ calls and no allocation. Copying the upload into the row is what keeps the upload
    untouched, and mixed precisions are compared in float32 (the copy converts a bf16 upload). No no_grad
    context (a few microseconds a call): uploads and task weights are detached tensors."""
    torch._foreach_copy_(views, trained)
    torch._foreach_sub_(views, sent)
    norm = float(torch.linalg.vector_norm(row))  # float32: a norm that overflows it is non-finite
    return UpdateSize(norm if math.isfinite(norm) else math.inf, row.numel())


class _PackedPair(NamedTuple):
    """A packed result and its packed task, alike: the parts of their buffers the screen reads."""

    uploaded: torch.Tensor  # the result's trained tensors, in `layout` order
    sent: torch.Tensor  # the task's
    statistics: torch.Tensor  # the result's running statistics
    sent_statistics: torch.Tensor  # the task's
    layout: PackLayout


def _packed_pair(task: Task, result: Result) -> _PackedPair | None:
    """Both packed alike, holding every floating tensor, or None (the per-tensor path then)."""
    uploaded, sent = packing(result.weights), packing(task.weights)
    if uploaded is None or sent is None:
        return None
    layout = uploaded.layout
    if layout is None or layout is not sent.layout or not layout.complete:
        return None
    if (
        uploaded.trained is None
        or sent.trained is None
        or uploaded.statistics is None
        or sent.statistics is None
    ):
        return None
    return _PackedPair(uploaded.trained, sent.trained, uploaded.statistics, sent.statistics, layout)


def _packed_statistics(pair: _PackedPair) -> UploadedStatistics:
    layout = pair.layout
    if not layout.statistic_keys:
        return NO_STATISTICS
    return UploadedStatistics(
        layout.statistic_keys,
        flat=pair.statistics,
        shapes=layout.statistic_shapes,
        layout=layout,
        sent_flat=pair.sent_statistics,
    )


def _packed_size(norm: float, layout: PackLayout) -> UpdateSize:
    return UpdateSize(norm if math.isfinite(norm) else math.inf, layout.trained_size)


def _subtract(row: torch.Tensor, pair: _PackedPair) -> UpdateSize:
    """row = uploaded − sent over the trained parts of two packed states: one vector operation."""
    torch.sub(pair.uploaded, pair.sent, out=row)
    return _packed_size(float(torch.linalg.vector_norm(row)), pair.layout)


def flat_update(task: Task, result: Result) -> FlatUpdate:
    """result − task in a fresh vector, over the trained floating tensors the result shares with its task."""
    packed = _packed_pair(task, result)
    if packed is not None:
        layout = packed.layout
        row = torch.empty(layout.trained_size, dtype=torch.float32)
        return FlatUpdate(
            layout.trained_keys,
            layout.trained_shapes,
            row,
            _subtract(row, packed),
            _packed_statistics(packed),
        )
    sent_weights = task.weights
    keys, statistic_keys = split_keys(result.weights, sent_weights)
    statistics = UploadedStatistics(
        statistic_keys,
        tuple(result.weights[k] for k in statistic_keys),
        sent=tuple(sent_weights[k] for k in statistic_keys),
    )
    if not keys:
        return EMPTY._replace(statistics=statistics)
    trained = [result.weights[k] for k in keys]
    sent = [sent_weights[k] for k in keys]
    shapes = tuple([t.shape for t in trained])
    if tuple([t.shape for t in sent]) != shapes:
        raise SpecError(f"result of {result.device_id} does not have its task's shapes")
    row = torch.empty(sum(math.prod(s) for s in shapes), dtype=torch.float32)
    return FlatUpdate(keys, shapes, row, _fill(row, views_of(row, shapes), trained, sent), statistics)


def update_size(task: Task, result: Result) -> UpdateSize:
    """L2 norm of result − task over the trained floating tensors the result carries; inf if non-finite."""
    return flat_update(task, result).size


class _RowPool:
    """The rows of one update layout (shapes): rows of one matrix, each with its views made once, lent to a
    round's results and given back. More results than rows get rows of their own; the matrix grows next round."""

    def __init__(self, shapes: Shapes, capacity: int) -> None:
        self.shapes = shapes
        self.size = sum(math.prod(s) for s in shapes)
        self.peak = 0  # most rows lent at once since the last reset
        self.lent = 0
        # The Gram matrix of rows written together (first row, entries), until one of them is lent again
        self.gram: tuple[int, list[list[float]]] | None = None
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.matrix = torch.empty(capacity, self.size, dtype=torch.float32)
        self.rows: list[tuple[torch.Tensor, list[torch.Tensor]] | None] = [None] * capacity
        self.gram = None
        self.free = list(range(capacity - 1, -1, -1))  # row 0 is lent first

    def take(self) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        """A row, its views, and its index in the matrix (-1: a row of its own)."""
        self.lent += 1
        self.peak = max(self.peak, self.lent)
        if not self.free:
            row = torch.empty(self.size, dtype=torch.float32)
            return row, views_of(row, self.shapes), -1
        index = self.free.pop()
        if self.gram is not None and 0 <= index - self.gram[0] < len(self.gram[1]):
            self.gram = None  # that row is about to be rewritten
        cached = self.rows[index]
        if cached is None:  # the same row object every round: its identity finds it again
            row = self.matrix[index]
            cached = self.rows[index] = (row, views_of(row, self.shapes))
        return cached[0], cached[1], index

    def give_back(self, index: int) -> None:
        self.lent -= 1
        if index >= 0:
            self.free.append(index)

    def reset(self, expected: int) -> None:
        """Every row free; at least `expected` rows (and as many as were lent at once last round)."""
        wanted = max(expected, self.peak)
        if wanted > self.matrix.shape[0]:
            self._allocate(wanted)
        else:
            self.free = list(range(self.matrix.shape[0] - 1, -1, -1))
        self.peak = self.lent = 0
        self.gram = None


def _norms(pool: _RowPool, first: int, count: int, gram: bool) -> list[float]:
    """The norms of `count` rows from `first`; with `gram`, from their Gram matrix, kept on the pool."""
    block = pool.matrix[first : first + count]
    if gram and count > 1:
        matrix = block.numpy()
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is looked at below
            entries = (matrix @ matrix.T).tolist()
        squares = [row[i] for i, row in enumerate(entries)]
        if all(math.isfinite(square) for square in squares):
            pool.gram = (first, entries)
            return [math.sqrt(square) for square in squares]
    return torch.linalg.vector_norm(block, dim=1).tolist()


class _KeyPlan:
    """How results with one key order are read against tasks with one key order: the floating keys they share,
    fetched in one C call per side, and a row pool per layout seen with them."""

    def __init__(self, keys: tuple[str, ...], statistic_keys: tuple[str, ...]) -> None:
        self.keys = keys
        self.statistic_keys = statistic_keys
        self.pick = _picker(keys)
        self.pick_statistics = _picker(statistic_keys)
        self.pools: dict[Shapes, _RowPool] = {}

    def statistics(
        self, weights: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]
    ) -> UploadedStatistics:
        """The result's running statistics and its task's (measured with the round's, server/running_statistics.py)."""
        if not self.statistic_keys:
            return NO_STATISTICS
        return UploadedStatistics(
            self.statistic_keys, self.pick_statistics(weights), sent=self.pick_statistics(sent)
        )


def _picker(keys: tuple[str, ...]) -> Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]:
    """These keys' tensors in one C call (itemgetter of one key returns the tensor, not a tuple)."""
    if len(keys) > 1:
        return itemgetter(*keys)
    if keys:
        return lambda tensors: (tensors[keys[0]],)
    return lambda tensors: ()


class UpdateWorkspace:
    """A round's flat updates, in rows reused from round to round.

    Results are expected validated against their tasks (names, shapes, dtypes), as the coordinator does before
    screening: which keys an update covers is worked out once per key order. The FlatUpdates returned are valid
    until `new_round`; layouts not used in the round just ended are dropped then, so memory follows the fleet."""

    def __init__(self) -> None:
        self._plans: dict[tuple[tuple[str, ...], tuple[str, ...]], _KeyPlan] = {}
        self._packed: dict[PackLayout, _RowPool] = {}  # packed results (nestling/packed.py), by layout
        self._lent: dict[
            int, tuple[torch.Tensor, _RowPool, int]
        ] = {}  # id(row) -> row, pool, index (this round)
        self._expected = 0

    def new_round(self, expected: int) -> None:
        """Every row is free again (earlier FlatUpdates must no longer be used); about `expected` results
        (the round's tasks) will arrive."""
        plans = {}
        for order, plan in self._plans.items():
            plan.pools = {shapes: pool for shapes, pool in plan.pools.items() if pool.peak}
            for pool in plan.pools.values():
                pool.reset(expected)
            if plan.pools:
                plans[order] = plan
        self._packed = {layout: pool for layout, pool in self._packed.items() if pool.peak}
        for pool in self._packed.values():
            pool.reset(expected)
        self._plans, self._lent, self._expected = plans, {}, expected

    def flat_update(self, task: Task, result: Result) -> FlatUpdate:
        """result − task in a lent row; give it back with `release` when the result is refused."""
        packed = _packed_pair(task, result)
        if packed is not None:
            return self._packed_update(packed)
        weights, sent_weights = result.weights, task.weights
        order = (tuple(weights), tuple(sent_weights))
        plan = self._plans.get(order)
        if plan is None:
            plan = self._plans[order] = _KeyPlan(*split_keys(weights, sent_weights))
        statistics = plan.statistics(weights, sent_weights)
        if not plan.keys:
            return EMPTY._replace(statistics=statistics)
        trained, sent = plan.pick(weights), plan.pick(sent_weights)
        shapes = tuple([t.shape for t in trained])
        pool = plan.pools.get(shapes)
        if pool is None:
            pool = plan.pools[shapes] = _RowPool(shapes, self._expected)
        row, views, index = pool.take()
        try:
            size = _fill(row, views, trained, sent)
        except RuntimeError as exc:  # a task tensor that does not match the result's shape
            pool.give_back(index)
            raise SpecError(f"result of {result.device_id} does not have its task's shapes") from exc
        self._lent[id(row)] = (row, pool, index)
        return FlatUpdate(plan.keys, pool.shapes, row, size, statistics)

    def packed(self, task: Task, result: Result) -> bool:
        """Whether this pair's update can wait for `flat_updates` (both packed alike): measured with the round's
        other packed results in a few operations instead of three per result."""
        return _packed_pair(task, result) is not None

    def flat_updates(self, pairs: list[tuple[Task, Result]], gram: bool = False) -> list[FlatUpdate]:
        """Each pair's update, as `flat_update` gives it; packed pairs of one layout are written into
        consecutive rows of their pool, one subtraction each, and their norms taken in one call per layout.

        With `gram` (the cohort screen will compare them), their Gram matrix instead of their norms: the cohort
        screen reads its dot products (`gram`) and the norms are the roots of its diagonal, so no pass over the
        updates is spent on norms alone (ten ResNet-20 updates: the screens' 9.2 ms became 8.0). Its float32
        sums differ from the norm's in the last digits; an update whose square is not finite there (an overflow
        the norm may not have) has all the norms taken as without it."""
        updates: list[FlatUpdate | None] = [None] * len(pairs)
        groups: dict[PackLayout, list[tuple[int, _PackedPair]]] = {}
        for i, (task, result) in enumerate(pairs):
            packed = _packed_pair(task, result)
            if packed is None or not packed.layout.trained_size:
                updates[i] = self.flat_update(task, result)
            else:
                groups.setdefault(packed.layout, []).append((i, packed))
        for layout, members in groups.items():
            pool = self._pool(layout, len(members))
            taken = [pool.take() for _ in members]
            rows = [row for row, _, _ in taken]
            first = taken[0][2]
            if first >= 0 and [index for _, _, index in taken] == list(range(first, first + len(taken))):
                # each row written once from its two inputs (a stack then an in-place subtraction passed over the
                # rows three times: 3.8 against 2.7 ms for ten ResNet-20 updates), then every norm in one call
                for row, (_, pair) in zip(rows, members, strict=True):
                    torch.sub(pair.uploaded, pair.sent, out=row)
                norms = _norms(pool, first, len(taken), gram)
            else:  # rows scattered (some were given back) or outside the matrix: one at a time
                for row, (_, pair) in zip(rows, members, strict=True):
                    torch.sub(pair.uploaded, pair.sent, out=row)
                norms = [float(torch.linalg.vector_norm(row)) for row in rows]
            for (row, _, index), (i, pair), norm in zip(taken, members, norms, strict=True):
                self._lent[id(row)] = (row, pool, index)
                updates[i] = FlatUpdate(
                    layout.trained_keys,
                    layout.trained_shapes,
                    row,
                    _packed_size(norm, layout),
                    _packed_statistics(pair),
                )
        return [update for update in updates if update is not None]

    def gram(self, updates: list[FlatUpdate]) -> list[list[float]] | None:
        """u_i · u_j for these updates, when `flat_updates` computed them for their rows (else None)."""
        held = self._rows_of(updates)
        gram = held[0].gram if held is not None else None
        if held is None or gram is None:
            return None
        first, entries = gram
        rows = held[1]
        at = [index - first for index in rows]
        if min(at) < 0 or max(at) >= len(entries):
            return None
        return [[entries[i][j] for j in at] for i in at]

    def _pool(self, layout: PackLayout, wanted: int) -> _RowPool:
        pool = self._packed.get(layout)
        if pool is None:
            pool = self._packed[layout] = _RowPool(layout.trained_shapes, max(self._expected, wanted))
        return pool

    def _packed_update(self, pair: _PackedPair) -> FlatUpdate:
        """A packed result against its packed task: one subtraction into the row, one norm."""
        layout = pair.layout
        if not layout.trained_size:
            return EMPTY._replace(statistics=_packed_statistics(pair))
        pool = self._pool(layout, 1)
        row, _, index = pool.take()
        size = _subtract(row, pair)
        self._lent[id(row)] = (row, pool, index)
        return FlatUpdate(layout.trained_keys, layout.trained_shapes, row, size, _packed_statistics(pair))

    def _lent_row(self, update: FlatUpdate) -> tuple[torch.Tensor, _RowPool, int] | None:
        lent = self._lent.get(id(update.vector))
        return lent if lent is not None and lent[0] is update.vector else None

    def release(self, update: FlatUpdate) -> None:
        """Give a refused result's row back for the next result of the round."""
        lent = self._lent_row(update)
        if lent is not None:
            del self._lent[id(update.vector)]
            lent[1].give_back(lent[2])

    def stacked(self, updates: list[FlatUpdate]) -> tuple[torch.Tensor, list[int]] | None:
        """The matrix whose rows hold all these updates (one layout) and where, or None."""
        held = self._rows_of(updates)
        return (held[0].matrix, held[1]) if held is not None else None

    def _rows_of(self, updates: list[FlatUpdate]) -> tuple[_RowPool, list[int]] | None:
        """The one pool whose matrix rows hold all these updates, and the rows; None otherwise (or no updates)."""
        pool, rows = None, []
        for update in updates:
            lent = self._lent_row(update)
            if lent is None or lent[2] < 0 or (pool is not None and lent[1] is not pool):
                return None
            pool = lent[1]
            rows.append(lent[2])
        return (pool, rows) if pool is not None else None
