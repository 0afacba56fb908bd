"""Fleet generator: seeded, exact class proportions, sane spreads, diurnal windows, a fast CLI."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from pathlib import Path

import pytest

from nestling.errors import ConfigError
from nestling.profiler.catalogue import get_board
from nestling.profiler.traces import load_traces
from nestling.simulator.generate import DAY_S, DEFAULT_MIX, generate_fleet, parse_mix, traces_generate_main


def test_same_seed_same_fleet_other_seed_other_fleet() -> None:
    mix = "rpi4:0.4,jetson-nano:0.3,phone-mid:0.3"
    assert generate_fleet(mix, 50, seed=3) == generate_fleet(mix, 50, seed=3)
    assert generate_fleet(mix, 50, seed=3) != generate_fleet(mix, 50, seed=4)


def test_class_proportions_are_exact() -> None:
    fleet = generate_fleet("rpi4:0.4,jetson-nano:0.3,phone-mid:0.3", 1000, seed=1)
    assert Counter(t.device_class for t in fleet) == {"rpi4": 400, "jetson-nano": 300, "phone-mid": 300}
    odd = Counter(t.device_class for t in generate_fleet({"rpi4": 1, "rpi5": 1, "laptop": 1}, 10, seed=1))
    assert sorted(odd.values()) == [3, 3, 4]


def test_classes_are_interleaved_not_blocked() -> None:
    fleet = generate_fleet("rpi4:0.5,phone-low:0.5", 100, seed=2)
    assert {t.device_class for t in fleet[:20]} == {"rpi4", "phone-low"}


def test_devices_vary_around_their_class_figures() -> None:
    fleet = generate_fleet("jetson-nano:1", 2000, seed=5)
    nano = get_board("jetson-nano")
    speeds = [t.gflops for t in fleet if t.gflops is not None]
    assert statistics.median(speeds) == pytest.approx(nano.sustained_gflops, rel=0.05)
    assert len(set(speeds)) > 1900
    assert statistics.median(t.up_bps for t in fleet) == pytest.approx(nano.up_bps, rel=0.1)
    assert all(t.memory_budget_bytes <= nano.ram_bytes for t in fleet)


def test_diurnal_windows_fit_the_day() -> None:
    fleet = generate_fleet("phone-mid:0.5,rpi4:0.5", 500, seed=7)
    phones = [t for t in fleet if t.device_class == "phone-mid"]
    assert all(t.period_s == DAY_S and t.availability for t in phones)
    for trace in fleet:
        assert all(0 <= start <= end <= DAY_S for start, end in trace.availability)
    night = [t.is_available(2 * DAY_S + 2 * 3600) for t in phones]  # 02:00
    noon = [t.is_available(2 * DAY_S + 12 * 3600) for t in phones]
    assert sum(night) > 0.8 * len(phones) > sum(noon)
    always_on = [t for t in fleet if t.device_class == "rpi4" and not t.availability]
    assert 0.5 < len(always_on) / 250 < 0.9


def test_without_diurnal_everyone_is_always_on() -> None:
    assert all(not t.availability for t in generate_fleet(None, 100, seed=0, diurnal=False))


def test_default_mix_spans_the_catalogue() -> None:
    assert parse_mix(None) == pytest.approx(DEFAULT_MIX)
    assert len(set(DEFAULT_MIX)) >= 8


@pytest.mark.parametrize(
    ("mix", "message"),
    [
        ("rpi4:0.5,toaster:0.5", "unknown board class 'toaster'"),
        ("rpi4", "'rpi4' is not CLASS:WEIGHT"),
        ("rpi4:-1", "weight of 'rpi4' must be a positive number"),
        ("rpi4:1,rpi4:2", "appears twice"),
    ],
)
def test_bad_mixes_are_named(mix: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_mix(mix)


def test_bad_device_count() -> None:
    with pytest.raises(ConfigError, match="positive integer"):
        generate_fleet(None, 0, seed=1)


def test_cli_writes_ten_thousand_devices_quickly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fleet.jsonl"
    started = time.perf_counter()
    code = traces_generate_main(
        [
            "--fleet",
            "rpi4:0.4,jetson-nano:0.3,phone-mid:0.3",
            "--devices",
            "10000",
            "--seed",
            "11",
            "--out",
            str(out),
        ]
    )
    elapsed = time.perf_counter() - started
    assert code == 0 and "wrote 10000 synthetic devices" in capsys.readouterr().out
    # About 0.2 s alone; a hang guard only (it took 6.7 s beside a reproduction on both cores). How fast
    # generation is belongs to a benchmark, not to a timed unit test.
    assert elapsed < 60.0
    assert load_traces(out) == generate_fleet("rpi4:0.4,jetson-nano:0.3,phone-mid:0.3", 10000, seed=11)


def test_churning_devices_start_online_and_come_and_go_until_the_horizon() -> None:
    from nestling.simulator.generate import with_sessions

    traces = generate_fleet("rpi3b:1,rpi-zero2w:1,rpi4:1,jetson-nano-cpu:1", 40, seed=5, diurnal=False)
    churned = with_sessions(traces, 0.5, 7200.0, 3600.0, 86400.0, seed=5)
    flaky = [t for t in churned if t.availability]
    assert len(flaky) == 20 and {t.device_class for t in churned} == {
        "rpi3b",
        "rpi-zero2w",
        "rpi4",
        "jetson-nano-cpu",
    }
    for before, after in zip(traces, churned, strict=True):
        assert (after.gflops, after.up_bps, after.device_id) == (
            before.gflops,
            before.up_bps,
            before.device_id,
        )
    for trace in flaky:
        assert trace.is_available(0.0) and trace.period_s is None
        assert trace.is_available(86400.0 * 2)  # online for good after the horizon
        starts = [s for s, _ in trace.availability]
        assert starts == sorted(starts) and trace.availability[0][0] == 0.0
    assert any(len(t.availability) > 2 for t in flaky)  # sessions, not one long window
    assert with_sessions(traces, 0.5, 7200.0, 3600.0, 86400.0, seed=5) == churned  # seeded
    with pytest.raises(ConfigError, match="share"):
        with_sessions(traces, 1.5, 7200.0, 3600.0, 86400.0, seed=5)
    with pytest.raises(ConfigError, match="mean_offline_s"):
        with_sessions(traces, 0.5, 7200.0, 0.0, 86400.0, seed=5)
