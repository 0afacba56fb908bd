"""What each method's model is made of, checked over every registered method (not only the paper's example)."""

from __future__ import annotations

import pytest

from nestling.models.zoo import build
from nestling.server.strategies import STRATEGIES, StrategyContext, create_strategy
from nestling.spec import SubmodelSpec


@pytest.mark.parametrize("arch", ["resnet20", "preresnet20", "vit"])
@pytest.mark.parametrize("method", sorted(STRATEGIES))
def test_only_nefl_trains_a_per_block_step(method: str, arch: str) -> None:
    """NeFL's learnable step scalars are NeFL's own: HeteroFL, FjORD, DepthFL, ScaleFL, FeDepth and FedAvg
    blocks have none, so their steps stay fixed at 1 and receive no gradient."""
    ctx = StrategyContext(
        arch=arch, num_classes=10, in_channels=3, image_size=32, num_clients=8, total_rounds=2, seed=0
    )
    try:
        strategy = create_strategy(method, ctx)
    except Exception as exc:  # a method that does not support this family says so by name
        pytest.skip(f"{method} on {arch}: {exc}")
    net = build(SubmodelSpec.full(strategy.model))
    steps = {name: p for name, p in net.named_parameters() if name.rpartition(".")[2].startswith("step")}
    assert steps, f"{arch} blocks carry no step scalar at all"
    trainable = {name for name, p in steps.items() if p.requires_grad}
    if method.startswith("nefl"):
        assert trainable == set(steps)
    else:
        assert not trainable, f"{method} trains NeFL's step sizes: {sorted(trainable)[:3]}"
        assert all(float(p) == 1.0 for p in steps.values())
