"""Clocks: the virtual one never runs backwards; a task's duration is compute + transfer + 2 latencies."""

from __future__ import annotations

import math

import pytest

from nestling.errors import ConfigError
from nestling.profiler.traces import DeviceTrace
from nestling.simulator.clock import Clock, VirtualClock, WallClock, task_duration


def test_both_clocks_satisfy_the_protocol() -> None:
    assert isinstance(WallClock(), Clock)
    assert isinstance(VirtualClock(), Clock)


def test_wall_clock_is_monotonic() -> None:
    clock = WallClock()
    first = clock.now()
    clock.sleep(0.0)
    assert clock.now() >= first


def test_virtual_clock_moves_only_forward() -> None:
    clock = VirtualClock(start=10.0)
    assert clock.now() == 10.0
    clock.advance_to(25.5)
    clock.advance_to(25.5)  # staying put is allowed
    assert clock.now() == 25.5
    with pytest.raises(ValueError, match=r"cannot go back from 25\.5 to 25\.4"):
        clock.advance_to(25.4)
    assert clock.now() == 25.5


def test_virtual_sleep_advances_instantly() -> None:
    clock = VirtualClock()
    clock.sleep(3600.0)
    clock.sleep(0.5)
    assert clock.now() == 3600.5
    with pytest.raises(ValueError, match="non-negative"):
        clock.sleep(-1.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_virtual_clock_rejects_non_finite_times(bad: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        VirtualClock().advance_to(bad)


def test_task_duration_adds_compute_transfer_and_two_latencies() -> None:
    trace = DeviceTrace(
        device_id="nano-1",
        device_class="jetson-nano",
        memory_budget_bytes=2**31,
        up_bps=10e6,
        down_bps=40e6,
        latency_s=0.05,
        gflops=50.0,
    )
    duration = task_duration(trace, train_flops=1e11, bytes_down=5_000_000, bytes_up=2_500_000)
    assert duration == pytest.approx(2.0 + 1.0 + 2.0 + 0.1)  # compute, down, up, latencies


def test_task_duration_uses_measured_latency_per_sample() -> None:
    trace = DeviceTrace(
        device_id="pi-1",
        device_class="rpi4",
        memory_budget_bytes=2**30,
        up_bps=8e6,
        down_bps=8e6,
        latency_s=0.0,
        block_latency_s={"resnet20": 0.25},
    )
    assert task_duration(trace, 0.0, 0, 0, model="resnet20", samples=8) == pytest.approx(2.0)
    with pytest.raises(ConfigError, match="no gflops"):
        task_duration(trace, 1e9, 0, 0, model="vit", samples=8)
