"""The server learns from a hello that a device emulates a slower board, logs it and lists it in summary.json."""

from __future__ import annotations

import logging

import pytest

from nestling.server.registry import DeviceRegistry, emulated_class


def test_emulating_devices_are_logged_and_listed(caplog: pytest.LogCaptureFixture) -> None:
    registry = DeviceRegistry()
    emulating = {
        "class": "rpi4",
        "trace_device": "rpi4-03",
        "gflops": 9.1,
        "up_bps": 4e7,
        "down_bps": 8e7,
        "latency_s": 0.02,
    }
    with caplog.at_level(logging.INFO, logger="nestling.registry"):
        registry.register("dev-00003", {"num_samples": 70, "emulating": emulating}, now=0.0)
        registry.register("dev-00004", {"num_samples": 70}, now=0.0)
    assert "emulating rpi4 (trace device rpi4-03)" in caplog.text
    assert registry.emulated() == {"dev-00003": emulating}
    assert emulated_class({"emulating": {"class": "phone-low"}}) == "phone-low"
    assert emulated_class({"emulating": "junk"}) is None and emulated_class(None) is None
