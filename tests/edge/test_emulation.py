"""Emulating a slower board: compute padded to its speed, transfers paced to its link, never sped up."""

from __future__ import annotations

import pytest

from nestling.edge.emulation import EmulatedDevice
from nestling.messages import Task
from nestling.models.config import ModelConfig
from nestling.models.cost import count_macs
from nestling.models.zoo import build
from nestling.profiler.catalogue import get_board
from nestling.profiler.speed import SpeedFigures, training_flops
from nestling.profiler.traces import DeviceTrace
from nestling.spec import SubmodelSpec


class Sleeps(list):
    """Records requested sleeps instead of sleeping."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def board(gflops: float = 10.0, up: float = 8e6, down: float = 16e6, latency: float = 0.02) -> SpeedFigures:
    return SpeedFigures(sustained_gflops=gflops, up_bps=up, down_bps=down, latency_s=latency)


def test_compute_is_padded_to_the_board_speed() -> None:
    sleeps = Sleeps()
    device = EmulatedDevice(board(gflops=10.0), sleep=sleeps)
    assert device.pad_to(device.compute_seconds(3e10), 0.5) == pytest.approx(2.5)  # 3 s on the board
    assert sleeps == [pytest.approx(2.5)]


def test_a_host_slower_than_the_board_is_not_padded_but_counted() -> None:
    sleeps = Sleeps()
    device = EmulatedDevice(board(gflops=10.0), sleep=sleeps)
    assert device.pad_to(device.compute_seconds(3e10), 4.0) == 0.0
    assert sleeps == [] and device.overrun_s == pytest.approx(1.0)


def test_transfers_are_paced_to_the_link_with_one_latency() -> None:
    sleeps = Sleeps()
    device = EmulatedDevice(board(up=8e6, down=16e6, latency=0.02), sleep=sleeps)
    assert device.pace_transfer(1_000_000, "up") == pytest.approx(1.02)
    assert device.pace_transfer(1_000_000, "down", elapsed_s=0.01) == pytest.approx(0.51)
    with pytest.raises(ValueError, match="direction"):
        device.pace_transfer(1, "sideways")


def test_catalogue_classes_are_emulated_directly() -> None:
    rpi4 = EmulatedDevice(get_board("rpi4"), sleep=Sleeps())
    assert rpi4.compute_seconds(9.6e9) == pytest.approx(1.0)
    assert rpi4.transfer_seconds(0, "up") == pytest.approx(get_board("rpi4").latency_s)


def test_training_flops_match_the_simulators_cost_formula() -> None:
    spec = SubmodelSpec(ModelConfig("tinycnn", num_classes=4, in_channels=3, image_size=8), width=0.5)
    model = build(spec)
    macs = count_macs(model, (3, 8, 8))
    assert training_flops(macs, 10) == macs * 2 * 3 * 10


def test_a_trace_device_is_emulated_with_its_own_figures() -> None:
    trace = DeviceTrace("pi-7", "rpi4", 2**30, up_bps=4e6, down_bps=8e6, latency_s=0.03, gflops=5.0)
    figures = SpeedFigures.from_trace(trace)
    assert figures == SpeedFigures(sustained_gflops=5.0, up_bps=4e6, down_bps=8e6, latency_s=0.03)
    measured_only = SpeedFigures.from_trace(
        DeviceTrace("x", "fedscale", 1, 1.0, 1.0, 0.0, block_latency_s={"*": 0.1})
    )
    assert measured_only.sustained_gflops is None and measured_only.block_latency_s == {"*": 0.1}
    with pytest.raises(ValueError, match="sustained_gflops is needed unless block_latency_s"):
        SpeedFigures(sustained_gflops=None, up_bps=1.0, down_bps=1.0)


def test_a_trace_device_with_only_measured_latency_is_paced_as_the_replay_predicts() -> None:
    """FedScale-style devices carry seconds per sample, no GFLOP/s: a submodel costs its MAC share."""
    from nestling.edge.emulation import EmulationTarget, TaskPacer
    from nestling.simulator.durations import TraceDurations

    trace = DeviceTrace(
        "fs-3", "fedscale", 2**30, up_bps=4e6, down_bps=8e6, latency_s=0.0, block_latency_s={"tinycnn": 0.02}
    )
    half = SubmodelSpec(ModelConfig("tinycnn", num_classes=4, in_channels=3, image_size=8), width=0.5)
    task = _task_on(half, {"local_epochs": 1, "batch_size": 8})  # 30 samples: 8+8+8+6
    predicted = TraceDurations({"dev-00000": trace}, {"dev-00000": 30}, (3, 8, 8)).cost(task)
    sleeps = Sleeps()
    pacer = TaskPacer(EmulationTarget.of_trace(trace), (3, 8, 8), sleep=sleeps, clock=FakeClock())
    record = pacer.compute(task, 30, measured_s=0.05)
    share = count_macs(build(half), (3, 8, 8)) / count_macs(build(SubmodelSpec.full(half.model)), (3, 8, 8))
    assert record.compute_s == pytest.approx(predicted.compute_s) == pytest.approx(0.02 * 30 * share)
    assert sleeps[-1] == pytest.approx(record.compute_s - 0.05)


def test_figures_must_be_positive() -> None:
    with pytest.raises(ValueError, match="up_bps"):
        SpeedFigures(sustained_gflops=1.0, up_bps=0.0, down_bps=1.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _task_on(spec: SubmodelSpec, hparams: dict) -> Task:
    return Task(
        round=3,
        device_id="dev-00000",
        spec=spec.to_dict(),
        weights=build(spec).state_dict(),
        procedure="sgd",
        hparams=hparams,
        task_id="r3-dev-00000",
    )


def test_an_emulating_agent_paces_each_phase_to_what_the_replay_predicts() -> None:
    from nestling.edge.emulation import EmulationTarget, TaskPacer
    from nestling.messages import Result
    from nestling.profiler.speed import payload_bytes
    from nestling.simulator.durations import TraceDurations

    trace = DeviceTrace("pi-7", "rpi4", 2**30, up_bps=4e6, down_bps=8e6, latency_s=0.03, gflops=0.05)
    spec = SubmodelSpec(ModelConfig("tinycnn", num_classes=4, in_channels=3, image_size=8), width=0.5)
    task = _task_on(spec, {"local_epochs": 2, "batch_size": 8})  # 30 samples: 8+8+8+6 twice = 60
    predicted = TraceDurations({"dev-00000": trace}, {"dev-00000": 30}, (3, 8, 8)).cost(task)
    sleeps, clock = Sleeps(), FakeClock()
    pacer = TaskPacer(EmulationTarget.of_trace(trace), (3, 8, 8), sleep=sleeps, clock=clock)
    first_chunk_at = clock.now
    clock.now += 0.01  # the rest of the task's chunks arrived 10 ms later
    down = pacer.download(task, first_chunk_at)
    assert down.down_s == pytest.approx(predicted.down_s) and sleeps[-1] == pytest.approx(
        predicted.down_s - 0.01
    )
    trained = pacer.compute(task, 30, measured_s=0.2)
    assert trained.compute_s == pytest.approx(predicted.compute_s)
    assert predicted.compute_s == pytest.approx(count_macs(build(spec), (3, 8, 8)) * 6 * 60 / 0.05e9)
    assert sleeps[-1] == pytest.approx(predicted.compute_s - 0.2)
    result = Result(
        round=3,
        device_id="dev-00000",
        task_id=task.task_id,
        spec_id=spec.id,
        weights=task.weights,
        num_samples=30,
        metrics={},
    )
    clock.now += 0.005  # encoding the result is part of sending it
    sent = pacer.upload(result, started=clock.now - 0.005)
    assert payload_bytes(result.weights) == payload_bytes(task.weights)
    assert sent.up_s == pytest.approx(predicted.up_s) and sleeps[-1] == pytest.approx(predicted.up_s - 0.005)
    assert sent.slept_s == pytest.approx(predicted.total_s - 0.01 - 0.2 - 0.005) and sent.overrun_s == 0.0
    assert sent.line(3, "rpi4").startswith("round 3: emulating rpi4: download ")


def test_a_host_slower_than_the_emulated_board_is_reported_per_task() -> None:
    from nestling.edge.emulation import EmulationTarget, TaskPacer

    spec = SubmodelSpec(ModelConfig("tinycnn", num_classes=4, in_channels=3, image_size=8))
    task = _task_on(spec, {"local_steps": 1, "batch_size": 4})
    pacer = TaskPacer(
        EmulationTarget("fast", board(gflops=1e6)), (3, 8, 8), sleep=Sleeps(), clock=FakeClock()
    )
    record = pacer.compute(task, 30, measured_s=1.0)
    assert record.slept_s == 0.0 and record.overrun_s == pytest.approx(1.0 - record.compute_s)


def test_a_board_class_or_a_trace_device_is_described_for_the_hello() -> None:
    from nestling.edge.emulation import EmulationTarget

    rpi4 = EmulationTarget.of_board(get_board("rpi4"))
    assert rpi4.describe() == {
        "class": "rpi4",
        "trace_device": None,
        "gflops": get_board("rpi4").sustained_gflops,
        "up_bps": get_board("rpi4").up_bps,
        "down_bps": get_board("rpi4").down_bps,
        "latency_s": get_board("rpi4").latency_s,
    }
    trace = DeviceTrace("pi-7", "rpi4", 2**30, up_bps=4e6, down_bps=8e6, latency_s=0.03, gflops=5.0)
    assert EmulationTarget.of_trace(trace).describe()["trace_device"] == "pi-7"
