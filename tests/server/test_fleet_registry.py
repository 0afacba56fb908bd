"""The client registry: profiles from hellos, liveness, and device indices that survive a server restart."""

from __future__ import annotations

import pytest

from nestling.errors import WireError
from nestling.server.registry import DeviceRegistry


def test_a_hello_becomes_device_info_and_indices_survive_a_restart(tmp_path):
    registry = DeviceRegistry(tmp_path / "registry.json")
    first = registry.register(
        "b", {"num_samples": 7, "index": 3, "labels": [2, 0, 2], "memory_budget_bytes": 1 << 20}, now=0.0
    )
    second = registry.register("a", {"num_samples": 9, "index": 3}, now=0.0)  # 3 is taken: next free index
    assert (first.index, first.labels, first.memory_budget_bytes) == (3, (0, 2), 1 << 20)
    assert second.index == 0
    restarted = DeviceRegistry(tmp_path / "registry.json")
    assert restarted.register("a", {"num_samples": 9}, now=1.0).index == 0
    assert restarted.register("b", {"num_samples": 7}, now=1.0).index == 3


def test_liveness_follows_last_will_and_heartbeats():
    registry = DeviceRegistry(heartbeat_timeout_s=10.0)
    registry.register("a", {"num_samples": 1}, now=0.0)
    registry.register("b", {"num_samples": 1}, now=0.0)
    assert registry.offline("a") and not registry.offline("a")
    registry.heartbeat("b", "training", now=8.0)
    assert registry.expire(now=15.0) == [] and [d.device_id for d in registry.available()] == ["b"]
    assert registry.expire(now=19.0) == ["b"] and registry.available() == []
    registry.register("a", {"num_samples": 1}, now=20.0)  # a device that comes back says hello again
    assert [d.device_id for d in registry.available()] == ["a"]


@pytest.mark.parametrize(
    "profile",
    [
        {},
        {"num_samples": -1},
        {"num_samples": 1.5},
        {"num_samples": True},
        {"num_samples": 1, "labels": "all"},
        {"num_samples": 1, "index": -1},
        {"num_samples": 1, "memory_budget_bytes": 0},
    ],
)
def test_unusable_profiles_are_refused_and_register_nothing(profile):
    registry = DeviceRegistry()
    with pytest.raises(WireError):
        registry.register("a", profile, now=0.0)
    assert not registry.known("a")


def test_only_allowed_devices_may_register():
    registry = DeviceRegistry(allowed={"a"})
    registry.register("a", {"num_samples": 1}, now=0.0)
    with pytest.raises(WireError, match="not in this fleet"):
        registry.register("b", {"num_samples": 1}, now=0.0)
