"""DepthFL's optional FedDyn: client regulariser and state, server correction (METHODS §7.3)."""

from __future__ import annotations

import torch

from nestling.edge.procedures.feddyn import STORE_KEY, FedDynTerm
from nestling.edge.procedures.registry import DeviceStore
from nestling.messages import Result
from nestling.models.config import ModelConfig
from nestling.models.zoo import build
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.server.strategies.base import DeviceInfo
from nestling.spec import SubmodelSpec


def test_client_term_starts_at_zero_and_updates_h() -> None:
    model = build(SubmodelSpec(ModelConfig("tinycnn", in_channels=1, image_size=16)))
    store = DeviceStore()
    dyn = FedDynTerm(model, store, alpha=0.1)
    assert float(dyn.penalty().detach()) == 0.0  # θ = θ_global and h = 0
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert float(dyn.penalty().detach()) > 0.0
    dyn.finish()
    for h in store[STORE_KEY].values():
        assert torch.allclose(h, torch.full_like(h, -0.1))  # h ← 0 − α(θ − θ_g) with θ − θ_g = 1
    again = FedDynTerm(model, store, alpha=0.1)  # the next participation starts from the stored h
    assert all(torch.equal(again.h[n], store[STORE_KEY][n]) for n in again.h)


def test_server_applies_the_feddyn_correction() -> None:
    ctx = StrategyContext(
        arch="tinycnn",
        num_classes=10,
        in_channels=1,
        image_size=16,
        num_clients=4,
        total_rounds=10,
        options={"feddyn_alpha": 0.5},
    )
    strategy = create_strategy("depthfl", ctx)
    old = {k: v.clone() for k, v in strategy.global_state.items()}
    devices = [DeviceInfo(f"dev-{i:05d}", i, 10) for i in (2, 3)]  # both in the deepest group (full model)
    tasks = strategy.assign(0, devices)
    accepted = []
    for task in tasks.values():
        trained = {k: v + 1.0 if v.is_floating_point() else v for k, v in task.weights.items()}
        accepted.append((task, Result(0, task.device_id, task.task_id, task.spec_id, trained, 10)))
    strategy.aggregate(0, accepted)
    key = "head.fc.weight"
    mean = old[key] + 1.0
    # h = −α·(2/4)·(θ̄ − θ_old) = −0.25; θ = θ̄ − h/α = θ̄ + 0.5
    assert torch.allclose(strategy.feddyn_h[key], torch.full_like(mean, -0.25))
    assert torch.allclose(strategy.global_state[key], mean + 0.5)
    assert "feddyn_h/head.fc.weight" in strategy.state_tensors()
