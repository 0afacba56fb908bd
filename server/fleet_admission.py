"""Whether a result that arrived over the network may reach the coordinator, and the counter naming why not."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from nestling.errors import WireError
from nestling.messages import Result, Task
from nestling.wire.codec import check_finite


@dataclass
class Dispatched:
    """A task the transport sent: what its result must look like (not the weights themselves)."""

    task_id: str
    round: int
    device_id: str
    spec_id: str
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]]
    limit: int  # largest acceptable encoded result, bytes
    # pending | dropped (device left, result still welcome) | refused (answered, a corrected one still welcome)
    # | accepted | cancelled
    state: str = "pending"
    frames: list[bytes] = field(default_factory=list)  # kept while open: resent if the broker lost them

    @classmethod
    def of(cls, task: Task, limit: int) -> Dispatched:
        expected = {k: (tuple(v.shape), v.dtype) for k, v in task.weights.items()}
        return cls(task.task_id, task.round, task.device_id, task.spec_id, expected, limit)


def wire_reason(error: WireError) -> str:
    """Counter name for a codec / chunking error: the reason the codec gave it (malformed by default)."""
    return error.reason


def unsolicited_reason(device_id: str, entries: Iterable[Dispatched]) -> str:
    """Why a result from a device without an open task is refused: its round closed, already applied, or never asked."""
    states = {e.state for e in entries if e.device_id == device_id}
    if "cancelled" in states:
        return "late"
    if "accepted" in states:
        return "duplicate"
    return "unknown_task"


def wrong_tensors(result: Result, entry: Dispatched) -> str | None:
    """A description of the first tensor that does not match the task (names, shapes, dtypes), else None.

    A result may omit tensors it did not train (ScaleFL's untouched keys) but never add or reshape any."""
    for name, tensor in result.weights.items():
        expected = entry.expected.get(name)
        if expected is None:
            return f"tensor {name!r} is not in the task"
        if (tuple(tensor.shape), tensor.dtype) != expected:
            return f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, task sent {expected[0]} {expected[1]}"
    return None


def check_result(
    device_id: str,
    result: Result,
    session: str,
    my_session: str,
    entry: Dispatched | None,
    current_round: int | None,
) -> str | None:
    """None when the result answers an open task of this server exactly, else the rejection reason."""
    if result.device_id != device_id:
        return "wrong_device"
    if session != my_session:
        return "stale_session"  # answers a task of a server process that no longer exists
    if current_round is not None and result.round > current_round:
        return "future"  # a round this server has not started: a forgery or a confused board, not an old one
    if entry is None or entry.device_id != device_id:
        return "stale" if current_round is not None and result.round < current_round - 1 else "unknown_task"
    if result.round != entry.round:
        return "future" if result.round > entry.round else "stale"
    if entry.state == "accepted":
        return "duplicate"
    if entry.state == "cancelled":
        return "late"
    if result.spec_id != entry.spec_id or wrong_tensors(result, entry) is not None:
        return "wrong_tensors"
    try:
        check_finite(result.weights)
    except WireError:
        return "non_finite"
    return None


class RecentKeys:
    """A bounded set: remembers the last `size` keys (transfer ids already counted as rejected)."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> bool:
        """True when `key` is new."""
        if key in self._keys:
            return False
        self._keys[key] = None
        if len(self._keys) > self.size:
            self._keys.popitem(last=False)
        return True
