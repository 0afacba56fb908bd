"""NeFL's per-submodel step sizes follow the declared role, not the parameter's name (METHODS §2.a.3, §2.a.6).

A family defined here calls its step size `gain` and has a shared weight called `step_bias`: with roles read
from names (the old rule) `gain` would be averaged across submodels and `step_bias` kept per submodel.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nestling.messages import Result, Task
from nestling.models.context import BuildContext
from nestling.models.family import ModelFamily, register_family, unregister_family
from nestling.models.net import BlockInfo
from nestling.models.roles import STEP, declare_role
from nestling.server.strategies import create_strategy
from nestling.server.strategies.nefl import NeFL

DIM = 24
NAME = "gain-mlp"


class Stem(nn.Module):
    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        self.fc = ctx.linear(
            ctx.model.in_channels * ctx.model.image_size**2, DIM, slim_out=True, in_ratio=1.0
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc(x.flatten(1)))


class GainBlock(nn.Module):
    """x + gain·ReLU(fc x) + step_bias: a NeFL step size by another name, and a weight named like one."""

    def __init__(self, ctx: BuildContext, *, skipped: bool) -> None:
        super().__init__()
        self.skipped = skipped
        if skipped:
            return
        self.fc = ctx.linear(DIM, DIM, slim_out=True)
        self.gain = nn.Parameter(torch.ones(1))
        self.step_bias = nn.Parameter(torch.zeros(ctx.channels(DIM)))
        declare_role(self, STEP, "gain")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.skipped else x + self.gain * F.relu(self.fc(x)) + self.step_bias


class Head(nn.Module):
    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        self.fc = ctx.classifier(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class GainMlp(ModelFamily):
    name = NAME

    def block_infos(self, image_size: int, extra: dict[str, Any]) -> tuple[BlockInfo, ...]:
        return tuple(BlockInfo(i, 0, DIM, DIM, 1, 1, 1) for i in range(2))

    def build_parts(self, spec, ctx, infos, kept, depth):  # type: ignore[no-untyped-def]
        blocks: list[nn.Module] = [GainBlock(ctx, skipped=i not in kept) for i in range(depth)]
        return Stem(ctx), blocks, {}, Head(ctx) if spec.head else None


@pytest.fixture(scope="module", autouse=True)
def gain_family() -> Iterator[None]:
    register_family(GainMlp)
    yield
    unregister_family(NAME)


def _upload(strategy: NeFL, k: int, client: int, value: float) -> tuple[Task, Result]:
    spec = strategy.specs[k]
    task = Task(
        0,
        f"dev-{client}",
        spec.to_dict(),
        strategy.task_weights(spec),
        strategy.procedure,
        task_id=f"t{client}",
    )
    weights = {
        n: torch.full_like(v, value) if v.is_floating_point() else v.clone() for n, v in task.weights.items()
    }
    return task, Result(0, task.device_id, task.task_id, task.spec_id, weights, num_samples=1)


def test_a_declared_step_is_kept_per_submodel_and_a_weight_named_step_is_shared(make_ctx) -> None:
    strategy = create_strategy("nefl-w", make_ctx(arch=NAME, in_channels=1, image_size=4, num_classes=3))
    assert isinstance(strategy, NeFL)
    assert all(set(store) == {"blocks.0.gain", "blocks.1.gain"} for store in strategy.stores)
    assert {"blocks.0.step_bias", "blocks.1.step_bias"} <= strategy.consistent
    assert not {"blocks.0.gain", "blocks.1.gain"} & strategy.consistent

    strategy.aggregate(
        0, [_upload(strategy, 1, 0, 1.0), _upload(strategy, 1, 1, 4.0), _upload(strategy, 3, 2, 7.0)]
    )
    gains = [float(store["blocks.0.gain"]) for store in strategy.stores]
    assert gains == [1.0, 2.5, 1.0, 7.0, 1.0]  # each submodel's own mean; unsampled submodels untouched
    held_by_both = strategy.task_weights(strategy.specs[1])["blocks.0.step_bias"].numel()
    shared = strategy.global_state["blocks.0.step_bias"]
    assert torch.all(shared[:held_by_both] == 4.0)  # one tensor averaged over all three uploads
