"""Boards and results for the round machinery's tests (coordinator, admission, guard, recorder): real tasks
from a real strategy, answered with real tensors."""

from __future__ import annotations

from typing import Any

import torch

from nestling.messages import Result, Task
from nestling.server.strategies import DeviceInfo


def fleet(n: int) -> list[DeviceInfo]:
    """n boards, board i registering 10 + i samples."""
    return [DeviceInfo(f"dev-{i:05d}", i, 10 + i) for i in range(n)]


def result_for(task: Task, value: float = 1.0, **changes: Any) -> Result:
    """The task's result with every float tensor set to `value` (integer buffers as sent), 10 samples."""
    weights = {
        k: torch.full_like(v, value) if v.is_floating_point() else v.clone() for k, v in task.weights.items()
    }
    fields: dict[str, Any] = {
        "round": task.round,
        "device_id": task.device_id,
        "task_id": task.task_id,
        "spec_id": task.spec_id,
        "weights": weights,
        "num_samples": 10,
    }
    fields.update(changes)
    return Result(**fields)
