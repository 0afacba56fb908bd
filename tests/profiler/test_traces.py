"""Device traces: availability windows, budgets, task cost arithmetic, and the JSONL/CSV files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nestling.errors import ConfigError
from nestling.profiler.traces import ANY_MODEL, DeviceTrace, load_traces, save_traces

DAY = 86400.0


def make_trace(**overrides: object) -> DeviceTrace:
    fields: dict[str, object] = dict(
        device_id="pi-1",
        device_class="rpi4",
        memory_budget_bytes=2**30,
        up_bps=8e6,
        down_bps=16e6,
        latency_s=0.02,
        gflops=10.0,
    )
    fields.update(overrides)
    return DeviceTrace(**fields)  # type: ignore[arg-type]


class TestAvailability:
    def test_no_windows_means_always_on(self) -> None:
        trace = make_trace()
        assert trace.is_available(0.0) and trace.is_available(1e9)
        assert trace.available_until(5.0) == math.inf
        assert trace.next_available(5.0) == 5.0

    def test_window_boundaries_are_inclusive(self) -> None:
        trace = make_trace(availability=[[10, 20]])
        assert not trace.is_available(9.999)
        assert trace.is_available(10.0)
        assert trace.is_available(20.0)
        assert not trace.is_available(20.001)

    def test_available_until_and_next_available_without_period(self) -> None:
        trace = make_trace(availability=[[10, 20], [30, 40]])
        assert trace.available_until(12.0) == 20.0
        assert trace.available_until(25.0) == 25.0  # offline: an empty stretch
        assert trace.next_available(25.0) == 30.0
        assert trace.next_available(41.0) == math.inf

    def test_touching_windows_form_one_stretch(self) -> None:
        trace = make_trace(availability=[[20, 30], [10, 20]])
        assert trace.available_until(11.0) == 30.0

    def test_periodic_windows_repeat(self) -> None:
        trace = make_trace(availability=[[3600, 7200]], period_s=DAY)
        assert trace.is_available(3 * DAY + 3600)
        assert not trace.is_available(3 * DAY + 7201)
        assert trace.available_until(2 * DAY + 5000) == 2 * DAY + 7200
        assert trace.next_available(2 * DAY + 8000) == 3 * DAY + 3600

    def test_night_window_continues_across_midnight(self) -> None:
        trace = make_trace(availability=[[0, 6 * 3600], [22 * 3600, DAY]], period_s=DAY)
        assert trace.is_available(DAY)  # midnight itself
        assert trace.available_until(23 * 3600) == DAY + 6 * 3600
        assert trace.available_until(DAY + 3600) == DAY + 6 * 3600
        assert not trace.is_available(DAY + 12 * 3600)

    def test_window_ending_at_period_without_next_start_closes_at_midnight(self) -> None:
        trace = make_trace(availability=[[22 * 3600, DAY]], period_s=DAY)
        assert trace.is_available(DAY)
        assert trace.available_until(DAY) == DAY
        assert not trace.is_available(DAY + 1)

    def test_window_covering_the_whole_period_is_always_on(self) -> None:
        trace = make_trace(availability=[[0, DAY]], period_s=DAY)
        assert trace.available_until(10 * DAY + 5) == math.inf

    @given(
        st.lists(st.tuples(st.integers(0, 99), st.integers(0, 30)), min_size=1, max_size=5),
        st.booleans(),
        st.floats(0, 1000, allow_nan=False),
    )
    def test_stretches_agree_with_point_queries(
        self, raw: list[tuple[int, int]], periodic: bool, t: float
    ) -> None:
        period = 100.0 if periodic else None
        windows = [[start, min(start + length, 100)] for start, length in raw]
        trace = make_trace(availability=windows, period_s=period)
        if trace.is_available(t):
            until = trace.available_until(t)
            assert until >= t
            horizon = min(until, t + 300)
            for fraction in (0.25, 0.5, 0.75, 1.0):
                assert trace.is_available(t + fraction * (horizon - t))
        else:
            assert trace.available_until(t) == t
            start = trace.next_available(t)
            assert start > t
            if start != math.inf:
                assert trace.is_available(start)
                assert not trace.is_available((t + start) / 2)


class TestBudgetAndCost:
    def test_budget_schedule_steps_at_its_times(self) -> None:
        trace = make_trace(budget_schedule=[[100, 2**29], [200, 2**28]])
        assert trace.budget_at(0.0) == 2**30
        assert trace.budget_at(100.0) == 2**29
        assert trace.budget_at(199.9) == 2**29
        assert trace.budget_at(1e6) == 2**28

    def test_budget_schedule_must_increase(self) -> None:
        with pytest.raises(ConfigError, match=r"budget_schedule.*strictly increasing"):
            make_trace(budget_schedule=[[100, 1], [100, 2]])

    def test_transfer_seconds_counts_bits_each_way(self) -> None:
        trace = make_trace(up_bps=8e6, down_bps=16e6)
        assert trace.transfer_seconds(bytes_up=1_000_000, bytes_down=2_000_000) == pytest.approx(2.0)
        assert trace.transfer_seconds(0, 0) == 0.0

    def test_compute_seconds_from_gflops(self) -> None:
        assert make_trace(gflops=10.0).compute_seconds(5e10) == pytest.approx(5.0)

    def test_measured_latency_wins_for_its_model(self) -> None:
        trace = make_trace(block_latency_s={"resnet20": 0.01, ANY_MODEL: 0.5})
        assert trace.compute_seconds(1e20, model="resnet20", samples=300) == pytest.approx(3.0)
        assert trace.compute_seconds(1e20, model="vit", samples=2) == pytest.approx(1.0)
        assert trace.compute_seconds(5e10, model="resnet20") == pytest.approx(5.0)  # no samples: FLOPs

    def test_latency_only_device_needs_samples(self) -> None:
        trace = make_trace(gflops=None, block_latency_s={"resnet20": 0.01})
        with pytest.raises(ConfigError, match=r"pi-1.*no gflops.*resnet20"):
            trace.compute_seconds(1e9, model="cnn", samples=10)

    def test_a_device_needs_some_speed(self) -> None:
        with pytest.raises(ConfigError, match="gflops or block_latency_s"):
            make_trace(gflops=None)


def write_lines(path: Path, records: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


class TestFiles:
    def test_jsonl_round_trip(self, tmp_path: Path) -> None:
        traces = [
            make_trace(availability=[[0, 10]], period_s=100.0, origin={"note": "lab"}),
            make_trace(
                device_id="pi-2", gflops=None, block_latency_s={"cnn": 0.2}, budget_schedule=[[5, 1024]]
            ),
        ]
        save_traces(traces, tmp_path / "fleet.jsonl")
        assert load_traces(tmp_path / "fleet.jsonl") == traces

    def test_csv_round_trip_keeps_list_columns(self, tmp_path: Path) -> None:
        traces = [
            make_trace(availability=[[0, 10], [20, 30]], period_s=50.0),
            make_trace(device_id="pi, two", block_latency_s={ANY_MODEL: 0.1}),
        ]
        save_traces(traces, tmp_path / "fleet.csv")
        assert load_traces(tmp_path / "fleet.csv") == traces

    def test_error_names_file_line_device_and_field(self, tmp_path: Path) -> None:
        good = make_trace().to_record()
        bad = dict(good, device_id="pi-9", up_bps=-5)
        path = write_lines(tmp_path / "t.jsonl", [good, "", bad])
        with pytest.raises(ConfigError, match=r"t\.jsonl:3: device 'pi-9': field 'up_bps': must be > 0"):
            load_traces(path)

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            ({"memory_budget_bytes": 1.5}, "field 'memory_budget_bytes': must be a whole number"),
            ({"availability": [[10, 5]]}, "field 'availability': window \\[10, 5\\] ends before"),
            ({"availability": [[0, 200]], "period_s": 100}, "exceeds period_s"),
            ({"latency": 0.1}, "field 'latency': unknown field"),
            ({"gflops": "fast"}, "field 'gflops': must be a finite number"),
        ],
    )
    def test_bad_values_are_named(self, tmp_path: Path, change: dict[str, object], message: str) -> None:
        path = write_lines(tmp_path / "t.jsonl", [dict(make_trace().to_record(), **change)])
        with pytest.raises(ConfigError, match=f"t\\.jsonl:1: .*{message}"):
            load_traces(path)

    def test_missing_field_and_broken_json(self, tmp_path: Path) -> None:
        record = make_trace().to_record()
        del record["down_bps"]
        with pytest.raises(ConfigError, match=r":1: .*field 'down_bps': missing"):
            load_traces(write_lines(tmp_path / "a.jsonl", [record]))
        with pytest.raises(ConfigError, match=r"b\.jsonl:2: not valid JSON"):
            load_traces(write_lines(tmp_path / "b.jsonl", [make_trace().to_record(), "{oops"]))

    def test_duplicate_device_points_at_first_use(self, tmp_path: Path) -> None:
        record = make_trace().to_record()
        with pytest.raises(ConfigError, match=r":2: device_id 'pi-1' already used on line 1"):
            load_traces(write_lines(tmp_path / "t.jsonl", [record, record]))

    def test_csv_error_has_its_row_line(self, tmp_path: Path) -> None:
        path = tmp_path / "t.csv"
        save_traces([make_trace(), make_trace(device_id="pi-2")], path)
        lines = path.read_text().splitlines()
        lines[2] = lines[2].replace("[", "").replace("]", "") + ",[[1,2]"
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(ConfigError, match=r"t\.csv:3: "):
            load_traces(path)

    def test_unknown_suffix_empty_and_missing_files(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match=r"unknown trace format '\.txt'"):
            save_traces([make_trace()], tmp_path / "t.txt")
        (tmp_path / "empty.jsonl").write_text("\n")
        with pytest.raises(ConfigError, match="no devices"):
            load_traces(tmp_path / "empty.jsonl")
        with pytest.raises(ConfigError, match="not found"):
            load_traces(tmp_path / "absent.jsonl")


def test_examples_in_docs_load(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "traces.md").read_text(encoding="utf-8")
    for fence, suffix in (("```json\n", ".jsonl"), ("```csv\n", ".csv")):
        example = text.split(fence, 1)[1].split("```", 1)[0]
        (tmp_path / f"example{suffix}").write_text(example)
        first = load_traces(tmp_path / f"example{suffix}")[0]
        assert first.device_id == "rpi4-07"
        assert first.available_until(23 * 3600) == DAY + 6 * 3600


def test_a_time_scaled_trace_keeps_its_board_and_runs_its_clock_faster() -> None:
    from nestling.profiler.traces import time_scaled

    day = DeviceTrace(
        "p",
        "phone-mid",
        2**30,
        up_bps=1e6,
        down_bps=2e6,
        latency_s=0.04,
        gflops=41.0,
        availability=((0.0, 21600.0), (79200.0, 86400.0)),
        period_s=86400.0,
        budget_schedule=((3600.0, 2**29),),
    )
    fast = time_scaled(day, 720.0)  # a day in two minutes
    assert fast.availability == ((0.0, 30.0), (110.0, 120.0)) and fast.period_s == 120.0
    assert fast.budget_schedule == ((5.0, 2**29),)
    assert (fast.gflops, fast.up_bps, fast.down_bps, fast.latency_s) == (41.0, 1e6, 2e6, 0.04)
    for t in (0.0, 29.0, 31.0, 100.0, 115.0, 150.0):
        assert fast.is_available(t) == day.is_available(t * 720.0)
    assert time_scaled(day, 1.0) is day
    for bad in (0, -3.0, float("nan"), "2"):
        with pytest.raises(ConfigError, match="time scale"):
            time_scaled(day, bad)  # type: ignore[arg-type]
