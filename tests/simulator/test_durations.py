"""Predicted task timings: MAC-based or measured compute, real payload bytes, dropouts by availability."""

from __future__ import annotations

import pytest
import torch

from nestling.messages import Task
from nestling.models.config import ModelConfig
from nestling.models.cost import count_macs
from nestling.models.zoo import build
from nestling.profiler.speed import training_flops
from nestling.profiler.traces import ANY_MODEL, DeviceTrace
from nestling.simulator.durations import TraceDurations, payload_bytes, samples_trained
from nestling.spec import SubmodelSpec

MODEL = ModelConfig("tinycnn", num_classes=4, in_channels=3, image_size=8)
SHAPE = (3, 8, 8)


def trace(**overrides: object) -> DeviceTrace:
    fields: dict[str, object] = {
        "device_id": "t0",
        "device_class": "rpi4",
        "memory_budget_bytes": 2**30,
        "up_bps": 8e6,
        "down_bps": 16e6,
        "latency_s": 0.05,
        "gflops": 0.01,
    }
    fields.update(overrides)
    return DeviceTrace(**fields)  # type: ignore[arg-type]


def task(width: float = 1.0, **hparams: object) -> Task:
    spec = SubmodelSpec(MODEL, width=width)
    return Task(
        round=0,
        device_id="dev-00000",
        spec=spec.to_dict(),
        weights=build(spec).state_dict(),
        procedure="sgd",
        hparams={"local_epochs": 2, "batch_size": 8, **hparams},
        task_id="r0-dev-00000",
    )


def model_for(device_trace: DeviceTrace, samples: int = 30) -> TraceDurations:
    return TraceDurations({"dev-00000": device_trace}, {"dev-00000": samples}, SHAPE)


def test_compute_is_macs_times_six_per_sample_over_sustained_speed() -> None:
    job = task()
    macs = count_macs(build(SubmodelSpec(MODEL)), SHAPE)
    cost = model_for(trace()).cost(job)
    assert training_flops(macs, 60) == macs * 2 * 3 * 60  # 2 epochs x 30 samples
    assert cost.compute_s == pytest.approx(macs * 6 * 60 / 0.01e9)


def test_transfers_carry_the_task_slice_each_way_with_one_latency_each() -> None:
    job = task(width=0.5)
    nbytes = payload_bytes(job.weights)
    assert nbytes > payload_bytes({k: v for k, v in job.weights.items() if v.dtype == torch.float32}) > 0
    cost = model_for(trace()).cost(job)
    assert cost.down_s == pytest.approx(8 * nbytes / 16e6 + 0.05)
    assert cost.up_s == pytest.approx(8 * nbytes / 8e6 + 0.05)
    assert cost.total_s == pytest.approx(cost.down_s + cost.compute_s + cost.up_s)


def test_smaller_submodels_train_faster_and_send_less() -> None:
    durations = model_for(trace())
    small, full = durations.cost(task(width=0.5)), durations.cost(task())
    assert small.compute_s < full.compute_s and small.up_s < full.up_s


def test_measured_latency_is_scaled_by_the_submodels_share_of_macs() -> None:
    durations = model_for(trace(gflops=None, block_latency_s={ANY_MODEL: 0.002}))
    half = SubmodelSpec(MODEL, width=0.5)
    ratio = count_macs(build(half), SHAPE) / count_macs(build(SubmodelSpec(MODEL)), SHAPE)
    assert durations.cost(task()).compute_s == pytest.approx(0.002 * 60)
    assert durations.cost(task(width=0.5)).compute_s == pytest.approx(0.002 * 60 * ratio)


def test_local_steps_fix_the_samples_trained() -> None:
    assert samples_trained({"local_steps": 5, "batch_size": 8}, 30) == 38  # 8+8+8+6, then 8 of the next pass
    assert samples_trained({"local_steps": 5, "batch_size": 10}, 30) == 50
    assert samples_trained({"local_steps": 5, "batch_size": 64}, 30) == 150  # a batch is at most the data
    assert samples_trained({"local_epochs": 3}, 30) == 90
    # 2 x ceil(9/4) = 6 steps of 4: each pass skips its single leftover sample, so the steps run on
    assert samples_trained({"local_epochs": 2, "batch_size": 4}, 9) == 24


@pytest.mark.parametrize("n", [1, 2, 7, 9, 16, 17, 30])
@pytest.mark.parametrize(
    "hp",
    [
        {"local_epochs": 1, "batch_size": 8},
        {"local_epochs": 3, "batch_size": 4},
        {"local_steps": 7, "batch_size": 8},
        {"local_steps": 3, "batch_size": 64},
        {"local_epochs": 2, "batch_size": 2},
    ],
)
def test_samples_trained_counts_what_the_local_procedures_really_draw(n: int, hp: dict) -> None:
    from nestling.edge.procedures import ClientData
    from nestling.edge.procedures.common import batches
    from nestling.task_params import TrainParams

    data = ClientData(torch.zeros(n, 1, 2, 2), torch.zeros(n, dtype=torch.long))
    drawn = sum(
        len(y) for _, y in batches(data, TrainParams.from_hparams(hp), torch.Generator().manual_seed(0))
    )
    assert samples_trained(hp, n) == drawn


def test_offline_at_dispatch_drops_at_once() -> None:
    arrival = model_for(trace(availability=[[100, 200]])).arrival(task(), now=50.0)
    assert arrival.dropped and arrival.seconds == 0.0


def test_going_offline_before_the_upload_ends_drops_when_it_goes() -> None:
    durations = model_for(trace(availability=[[0, 1000]]))
    total = durations.cost(task()).total_s
    late = durations.arrival(task(), now=1000.0 - total / 2)
    assert late.dropped and late.seconds == pytest.approx(total / 2)
    on_time = durations.arrival(task(), now=1000.0 - total - 1)
    assert not on_time.dropped and on_time.seconds == pytest.approx(total)
