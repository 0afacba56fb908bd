"""Fixtures shared across the suite: one torch thread (the machine is shared), small strategy contexts,
and fabricated client results shaped like a task's slice."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from nestling.messages import Result, Task

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A CLI under test configures the root logger (level INFO, a stderr handler) for the process: undo that, so
    later tests' libraries (amqtt's per-connection INFO lines) do not print through it."""
    from nestling.log_setup import CurrentStderrHandler

    root = logging.getLogger()
    level, ours = root.level, [h for h in root.handlers if isinstance(h, CurrentStderrHandler)]
    yield
    root.setLevel(level)
    for handler in [h for h in root.handlers if isinstance(h, CurrentStderrHandler) and h not in ours]:
        root.removeHandler(handler)


@pytest.fixture
def make_ctx() -> Callable[..., Any]:
    """StrategyContext factory: a tiny 8×8, 4-class setting unless overridden."""
    from nestling.server.strategies import StrategyContext

    def factory(**overrides: Any) -> StrategyContext:
        values: dict[str, Any] = {
            "arch": "tinycnn",
            "num_classes": 4,
            "in_channels": 3,
            "image_size": 8,
            "num_clients": 8,
            "total_rounds": 4,
            "seed": 0,
        }
        values.update(overrides)
        return StrategyContext(**values)

    return factory


@pytest.fixture
def fake_result() -> Callable[..., Result]:
    """A Result for `task` whose float tensors are random (seeded), integer buffers copied from the task."""

    def factory(task: Task, *, seed: int = 0, num_samples: int = 10, drop: tuple[str, ...] = ()) -> Result:
        generator = torch.Generator().manual_seed(seed)
        weights = {}
        for key, value in task.weights.items():
            if key in drop:
                continue
            if value.is_floating_point():
                weights[key] = torch.randn(value.shape, generator=generator, dtype=value.dtype)
            else:
                weights[key] = value.clone()
        return Result(
            round=task.round,
            device_id=task.device_id,
            task_id=task.task_id,
            spec_id=task.spec_id,
            weights=weights,
            num_samples=num_samples,
        )

    return factory
