"""The FeDepth claim, measured: with the memory of the 1/6-width PreResNet-20 a client trains the full-width model,
every stage's peak (saved activations + weights, gradients and momentum of what it trains) within budget × 1.05;
the same for the lack budget (1/8) with partial training."""

from __future__ import annotations

import pytest
import torch

from nestling.edge.procedures import ClientData
from nestling.edge.procedures.depthwise import measure_stage_peaks
from nestling.models import build
from nestling.profiler.decompose import StagePlan
from nestling.profiler.measure import profile_model
from nestling.server.strategies import DeviceInfo, StrategyContext, create_strategy
from nestling.spec import SubmodelSpec
from nestling.task_params import FedepthParams

BATCH = 32


def measured_stage_peaks(budgets: str) -> tuple[list[int], int, StagePlan, int]:
    ctx = StrategyContext(
        arch="preresnet20",
        num_classes=10,
        in_channels=3,
        image_size=32,
        num_clients=4,
        total_rounds=1,
        local={"batch_size": BATCH, "momentum": 0.9, "local_steps": 2},
        options={"budgets": budgets},
    )
    strategy = create_strategy("fedepth", ctx)
    device = DeviceInfo("weakest", index=0, num_samples=64)  # tier 0: the smallest budget of the preset
    task = strategy.assign(0, [device])["weakest"]
    plan = StagePlan.from_dict(task.hparams["plan"])
    ratio = strategy.ratios[0]
    measured_budget = profile_model(
        SubmodelSpec(strategy.model, width=ratio), BATCH, repeats=1, warmup=1, momentum=0.9, rss_check=False
    )["total"]["peak_training_bytes"]
    net = build(SubmodelSpec.from_dict(task.spec), init=False)
    net.load_state_dict(task.weights)
    generator = torch.Generator().manual_seed(0)
    data = ClientData(
        torch.randn(64, 3, 32, 32, generator=generator), torch.randint(0, 10, (64,), generator=generator)
    )
    peaks = measure_stage_peaks(
        [net], plan, data, FedepthParams.from_hparams({**task.hparams, "lr": 0.01}), generator
    )
    return peaks, measured_budget, plan, strategy.ratio_bytes[ratio]


@pytest.mark.parametrize("budgets, bypassed", [("fair", False), ("lack", True)])
def test_every_stage_of_the_full_model_fits_the_narrow_models_memory(budgets: str, bypassed: bool) -> None:
    peaks, budget, plan, planned_budget = measured_stage_peaks(budgets)
    assert planned_budget == budget  # the server's estimate of R(r) is what the board measures
    assert plan.num_stages > 1 and bool(plan.bypass) == bypassed
    trained = [b for stage in plan.stages for b in stage]
    assert list(plan.bypass) + trained == list(range(9))  # the whole body is covered
    assert max(peaks) <= budget * 1.05
    assert max(peaks) > budget * 0.8  # stages are packed, not trivially small
