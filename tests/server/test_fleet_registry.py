"""The client registry: profiles from hellos, liveness, and device indices that survive a server restart."""

from __future__ import annotations

import pytest

from nestling.errors import WireError
from nestling.server.enrolment import Enrolment
from nestling.server.registry import DeviceRegistry


def test_a_hello_becomes_device_info_and_open_seats_survive_a_restart(tmp_path):
    registry = DeviceRegistry(tmp_path / "registry.json", enrolment=Enrolment.open_to(3))
    first = registry.register(
        "b", {"num_samples": 7, "index": 3, "labels": [2, 0, 2], "memory_budget_bytes": 1 << 20}, now=0.0
    )
    second = registry.register("a", {"num_samples": 9, "index": 0, "tier": 4}, now=0.0)
    # Seats go in order of arrival: the index and tier a hello claims are not the board's to choose.
    assert (first.index, first.labels, first.memory_budget_bytes) == (0, (0, 2), 1 << 20)
    assert (second.index, second.tier) == (1, None)
    restarted = DeviceRegistry(tmp_path / "registry.json", enrolment=Enrolment.open_to(3))
    assert restarted.register("a", {"num_samples": 9}, now=1.0).index == 1
    assert restarted.register("b", {"num_samples": 7}, now=1.0).index == 0
    assert restarted.register("c", {"num_samples": 7}, now=1.0).index == 2
    with pytest.raises(WireError, match="seats are taken") as refused:  # a stranger cannot add a 4th board
        restarted.register("ghost-1", {"num_samples": 7}, now=1.0)
    assert refused.value.reason == "not_enrolled" and not restarted.known("ghost-1")


def test_a_closed_enrolment_sets_indices_and_tiers_whatever_the_hello_claims(tmp_path):
    enrolment = Enrolment.closed(["a", "b", "c"], {"c": 2})
    registry = DeviceRegistry(tmp_path / "registry.json", enrolment=enrolment)
    claimed = {"num_samples": 5, "index": 0, "tier": 0}  # every board claims index 0 and the smallest tier
    infos = [registry.register(d, claimed, now=0.0) for d in ("c", "b", "a")]
    assert [(i.device_id, i.index, i.tier) for i in infos] == [("c", 2, 2), ("b", 1, None), ("a", 0, None)]
    assert registry.indices == {"a": 0, "b": 1, "c": 2}


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


def test_only_enrolled_devices_may_register():
    registry = DeviceRegistry(enrolment=Enrolment.closed(["a"]))
    registry.register("a", {"num_samples": 1}, now=0.0)
    with pytest.raises(WireError, match="'b' is not enrolled") as refused:
        registry.register("b", {"num_samples": 1}, now=0.0)
    assert refused.value.reason == "not_enrolled" and not registry.known("b")


def test_a_refused_hello_takes_no_open_seat():
    registry = DeviceRegistry(enrolment=Enrolment.open_to(1))
    with pytest.raises(WireError):
        registry.register("bad", {"num_samples": -1}, now=0.0)
    assert registry.register("good", {"num_samples": 1}, now=0.0).index == 0
