"""The client registry: profiles from hellos, liveness, and device indices that survive a server restart."""

from __future__ import annotations

import json

import pytest

from nestling.errors import WireError
from nestling.profiler.board_profile import MAX_PARTS, SCHEMA
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


def _measured_profile(parts: int) -> dict:
    """A valid measured profile of `parts` parts (MAX_PARTS: the most a hello can make the registry keep, ~20 KB)."""
    part = {"forward_s": 0.001, "backward_s": 0.002, "activation_bytes": 4096}
    return {
        "schema": SCHEMA,
        "spec_id": "0123456789ab",
        "arch": "resnet110",
        "batch": 32,
        "memory_bytes": 2**31,
        "margin": 0.2,
        "gflops": 9.6,
        "step_s": 0.003 * parts * 1.2,
        "parts": [{**part, "name": f"block{i}"} for i in range(parts)],
        "source": "measured",
    }


def test_a_flood_of_1000_hellos_writes_amortised_constant_bytes_per_hello_and_survives_a_restart(tmp_path):
    """Each hello appends one journal line (it used to rewrite every profile: 63 hellos took 70 s); the snapshot
    is rewritten only when the journal outgrows the fleet, so the bytes written per hello stay bounded however
    large the fleet grows. Counted in bytes, not timed: a timing on a shared 2-core box says little."""
    path = tmp_path / "registry.json"
    registry = DeviceRegistry(path)
    profile = _measured_profile(64)
    written, snapshots, line_sizes = 0, 0, []
    # 1000 new boards, then 1500 hellos again from ones already known (each a journal line that the fleet's
    # size does not cover, so the journal is folded into a snapshot once it outgrows the fleet)
    hellos = [f"board-{i:04d}" for i in range(1000)] + [f"board-{i % 7:04d}" for i in range(1500)]
    for n, device_id in enumerate(
        hellos
    ):  # a changed sample count each time: an unchanged hello writes nothing
        journal_before = registry.journal.stat().st_size if registry.journal.exists() else 0
        registry.register(device_id, {"num_samples": 1000 + n, "board_profile": profile}, now=0.0)
        journal_after = registry.journal.stat().st_size if registry.journal.exists() else 0
        if journal_after > journal_before:  # one line appended
            line_sizes.append(journal_after - journal_before)
            written += journal_after - journal_before
        else:  # the journal was folded into a fresh snapshot
            snapshots += 1
            written += path.stat().st_size
    line = max(line_sizes)
    assert max(line_sizes) - min(line_sizes) < 16  # one line per hello, the same size whoever sends it
    assert snapshots == 2  # 2500 lines against a fleet of 1000: folded each time it outgrows the fleet
    assert (
        written < 3 * len(hellos) * line
    )  # amortised O(1) per hello; a rewrite per hello would be ~500x this
    before = {d: registry.indices[d] for d in registry.indices}
    restarted = DeviceRegistry(path)  # replays the journal into a fresh snapshot
    assert restarted.indices == before and len(before) == 1000
    assert not restarted.journal.exists()
    stored = json.loads(path.read_text())
    assert (
        len(stored["devices"]) == 1000
        and len(stored["devices"]["board-0999"]["board_profile"]["parts"]) == 64
    )
    assert restarted.register("board-0500", {"num_samples": 10}, now=1.0).index == before["board-0500"]


def test_the_largest_profile_is_kept_whole_across_a_restart(tmp_path):
    path = tmp_path / "registry.json"
    DeviceRegistry(path).register(
        "big", {"num_samples": 3, "board_profile": _measured_profile(MAX_PARTS)}, 0.0
    )
    stored = json.loads(path.with_name("registry.json.journal").read_text())["entry"]
    assert len(stored["board_profile"]["parts"]) == MAX_PARTS
    assert "big" in json.loads(DeviceRegistry(path).path.read_text())["devices"]


def test_a_journal_cut_short_by_a_crash_keeps_every_complete_line(tmp_path):
    path = tmp_path / "registry.json"
    registry = DeviceRegistry(path)
    for i in range(3):
        registry.register(
            f"b{i}", {"num_samples": 1, "index": 10 + i}, now=0.0
        )  # claimed indices are ignored
    with registry.journal.open("a") as fh:
        fh.write('{"device": "b9", "ind')  # the process died mid-line
    assert DeviceRegistry(path).indices == {"b0": 0, "b1": 1, "b2": 2}


def test_re_hellos_that_change_a_profile_keep_the_journal_bounded(tmp_path):
    registry = DeviceRegistry(tmp_path / "registry.json")
    for round_ in range(50):
        for i in range(4):
            registry.register(f"b{i}", {"num_samples": 1 + round_}, now=0.0)
    assert len(registry.journal.read_text().splitlines()) <= 65  # compacted past max(64, fleet size)
    assert DeviceRegistry(tmp_path / "registry.json").register("b3", {"num_samples": 1}, now=0.0).index == 3
