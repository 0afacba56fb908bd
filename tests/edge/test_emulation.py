"""Emulating a slower board: compute padded to its speed, transfers paced to its link, never sped up."""

from __future__ import annotations

import pytest

from edge.emulation import EmulatedDevice, SpeedFigures, model_training_flops, training_flops
from nestling.models.config import ModelConfig
from nestling.models.cost import count_macs
from nestling.models.zoo import build
from nestling.spec import SubmodelSpec
from simulator.catalogue import get_board
from simulator.traces import DeviceTrace


class Sleeps(list):
    """Records requested sleeps instead of sleeping."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def board(gflops: float = 10.0, up: float = 8e6, down: float = 16e6, latency: float = 0.02) -> SpeedFigures:
    return SpeedFigures(sustained_gflops=gflops, up_bps=up, down_bps=down, latency_s=latency)


def test_compute_is_padded_to_the_board_speed() -> None:
    sleeps = Sleeps()
    device = EmulatedDevice(board(gflops=10.0), sleep=sleeps)
    assert device.pad_compute(measured_s=0.5, train_flops=3e10) == pytest.approx(2.5)  # 3 s on the board
    assert sleeps == [pytest.approx(2.5)]


def test_a_host_slower_than_the_board_is_not_padded_but_counted() -> None:
    sleeps = Sleeps()
    device = EmulatedDevice(board(gflops=10.0), sleep=sleeps)
    assert device.pad_compute(measured_s=4.0, train_flops=3e10) == 0.0
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
    assert model_training_flops(model, (3, 8, 8), 10) == training_flops(macs, 10)


def test_a_trace_device_is_emulated_with_its_own_figures() -> None:
    trace = DeviceTrace("pi-7", "rpi4", 2**30, up_bps=4e6, down_bps=8e6, latency_s=0.03, gflops=5.0)
    figures = SpeedFigures.from_trace(trace)
    assert figures == SpeedFigures(sustained_gflops=5.0, up_bps=4e6, down_bps=8e6, latency_s=0.03)
    with pytest.raises(ValueError, match="no gflops"):
        SpeedFigures.from_trace(DeviceTrace("x", "fedscale", 1, 1.0, 1.0, 0.0, block_latency_s={"*": 0.1}))


def test_figures_must_be_positive() -> None:
    with pytest.raises(ValueError, match="up_bps"):
        SpeedFigures(sustained_gflops=1.0, up_bps=0.0, down_bps=1.0)
