"""Device traces: what one device can compute and send, when it is online, and the files holding them.

Format (docs/traces.md): JSONL, one device per line, or CSV whose list/dict columns hold JSON.
Times are seconds of virtual time, bandwidths bits per second, memory bytes.
"""

from __future__ import annotations

import csv
import json
import math
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from itertools import pairwise
from pathlib import Path
from typing import Any

from nestling.errors import ConfigError
from nestling.profiler.speed import ANY_MODEL
from nestling.strict_json import strict_dumps


class TraceFieldError(ConfigError):
    """One field of a trace holds a wrong value; keeps the field name so a loader can point at it."""

    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"field '{field_name}': {problem}")
        self.field_name = field_name
        self.problem = problem


def _number(name: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceFieldError(name, f"must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise TraceFieldError(name, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def _byte_count(name: str, value: object) -> int:
    number = _number(name, value)
    if not float(number).is_integer():
        raise TraceFieldError(name, f"must be a whole number of bytes, got {value!r}")
    return int(number)


def _pairs(name: str, value: object) -> list[tuple[object, object]]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(item, (list, tuple)) and len(item) == 2 for item in value
    ):
        raise TraceFieldError(name, f"must be a list of [a, b] pairs, got {value!r}")
    return [(a, b) for a, b in value]


@dataclass(frozen=True)
class DeviceTrace:
    """One device's capacities and availability; the simulator's only knowledge of that device."""

    device_id: str
    device_class: str
    memory_budget_bytes: int
    up_bps: float
    down_bps: float
    latency_s: float
    gflops: float | None = None
    block_latency_s: dict[str, float] | None = None
    availability: tuple[tuple[float, float], ...] = ()
    period_s: float | None = None
    budget_schedule: tuple[tuple[float, int], ...] = ()
    origin: dict[str, Any] | None = None
    _starts: list[float] = field(init=False, repr=False, compare=False)
    _ends: list[float] = field(init=False, repr=False, compare=False)
    _budget_times: list[float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("device_id", "device_class"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise TraceFieldError(name, f"must be a non-empty string, got {value!r}")
        put = object.__setattr__
        put(self, "memory_budget_bytes", _byte_count("memory_budget_bytes", self.memory_budget_bytes))
        put(self, "up_bps", _number("up_bps", self.up_bps))
        put(self, "down_bps", _number("down_bps", self.down_bps))
        put(self, "latency_s", _number("latency_s", self.latency_s, allow_zero=True))
        if self.gflops is not None:
            put(self, "gflops", _number("gflops", self.gflops))
        if self.block_latency_s is not None:
            if not isinstance(self.block_latency_s, Mapping) or not self.block_latency_s:
                raise TraceFieldError(
                    "block_latency_s", "must be a non-empty {model: seconds per sample} map"
                )
            put(
                self,
                "block_latency_s",
                {
                    str(model): _number(f"block_latency_s.{model}", seconds)
                    for model, seconds in self.block_latency_s.items()
                },
            )
        if self.gflops is None and self.block_latency_s is None:
            raise TraceFieldError("gflops", "give gflops or block_latency_s (the device needs a speed)")
        if self.period_s is not None:
            put(self, "period_s", _number("period_s", self.period_s))
        put(self, "availability", self._checked_windows())
        put(self, "budget_schedule", self._checked_schedule())
        if self.origin is not None and not isinstance(self.origin, Mapping):
            raise TraceFieldError("origin", f"must be a JSON object, got {self.origin!r}")
        starts, ends = _merge(self.availability)
        put(self, "_starts", starts)
        put(self, "_ends", ends)
        put(self, "_budget_times", [time for time, _ in self.budget_schedule])

    def _checked_windows(self) -> tuple[tuple[float, float], ...]:
        windows = []
        for start, end in _pairs("availability", self.availability):
            start_s = _number("availability", start, allow_zero=True)
            end_s = _number("availability", end, allow_zero=True)
            if end_s < start_s:
                raise TraceFieldError("availability", f"window [{start}, {end}] ends before it starts")
            if self.period_s is not None and end_s > self.period_s:
                raise TraceFieldError(
                    "availability", f"window [{start}, {end}] exceeds period_s {self.period_s}"
                )
            windows.append((start_s, end_s))
        return tuple(windows)

    def _checked_schedule(self) -> tuple[tuple[float, int], ...]:
        schedule = [
            (_number("budget_schedule", t, allow_zero=True), _byte_count("budget_schedule", budget))
            for t, budget in _pairs("budget_schedule", self.budget_schedule)
        ]
        if any(later[0] <= earlier[0] for earlier, later in pairwise(schedule)):
            raise TraceFieldError("budget_schedule", "times must be strictly increasing")
        return tuple(schedule)

    # --- availability: windows are closed [start, end], as FedScale's client_behave_trace ---

    def _cycle(self, t: float) -> tuple[float, float]:
        """(start of the period containing t, t within it); the whole time line when not periodic.

        A t within rounding error below a cycle boundary belongs to the next cycle: `t mod period`
        would otherwise read it as the last instant of the old cycle, so a device whose window opens
        at the boundary looked offline there and `next_available` answered the adjacent float, with
        no offline time in between (found by test_stretches_agree_with_point_queries).
        """
        if self.period_s is None:
            return 0.0, t
        offset = t % self.period_s
        if self.period_s - offset <= 4.0 * math.ulp(t):
            return t - offset + self.period_s, 0.0
        return t - offset, offset

    def _window_at(self, offset: float) -> int | None:
        index = bisect_right(self._starts, offset) - 1
        return index if index >= 0 and offset <= self._ends[index] else None

    def is_available(self, t: float) -> bool:
        """Whether the device is online at virtual time t (always, when it has no windows)."""
        if not self._starts:
            return True
        _, offset = self._cycle(t)
        if self._window_at(offset) is not None:
            return True
        # t = k x period is also the closing instant of the previous cycle's last window.
        return offset == 0.0 and self.period_s is not None and self._ends[-1] >= self.period_s

    def available_until(self, t: float) -> float:
        """When the online stretch containing t ends (inf if never); t itself when offline at t."""
        if not self._starts:
            return math.inf
        if not self.is_available(t):
            return t
        base, offset = self._cycle(t)
        index = self._window_at(offset)
        if index is None:  # only the closing instant of the previous cycle
            return t
        if self.period_s is None:
            return self._ends[index]
        wraps = self._ends[index] >= self.period_s and self._starts[0] == 0.0
        if wraps and len(self._starts) == 1:
            return math.inf
        if wraps:
            return base + self.period_s + self._ends[0]
        return base + self._ends[index]

    def next_available(self, t: float) -> float:
        """The earliest time >= t the device is online (inf if never again)."""
        if self.is_available(t):
            return t
        base, offset = self._cycle(t)
        index = bisect_right(self._starts, offset)
        if index < len(self._starts):
            return base + self._starts[index]
        return math.inf if self.period_s is None else base + self.period_s + self._starts[0]

    def budget_at(self, t: float) -> int:
        """Memory budget in bytes at time t: the last schedule entry at or before t, else the base."""
        index = bisect_right(self._budget_times, t) - 1
        return self.budget_schedule[index][1] if index >= 0 else self.memory_budget_bytes

    # --- cost of a task ---

    def compute_seconds(
        self, train_flops: float, model: str | None = None, samples: int | None = None
    ) -> float:
        """Training time: measured seconds/sample x samples when known for the model, else FLOPs / speed."""
        latencies = self.block_latency_s or {}
        per_sample = latencies.get(model, latencies.get(ANY_MODEL)) if model else latencies.get(ANY_MODEL)
        if per_sample is not None and samples is not None:
            return per_sample * _number("samples", samples, allow_zero=True)
        if self.gflops is None:
            raise ConfigError(
                f"[trace] device '{self.device_id}' has no gflops, and no measured latency applies to "
                f"model={model!r}, samples={samples!r} "
                f"(latencies known for: {', '.join(latencies) or 'none'})"
            )
        return _number("train_flops", train_flops, allow_zero=True) / (self.gflops * 1e9)

    def transfer_seconds(self, bytes_up: int, bytes_down: int) -> float:
        """Time on the wire for these payloads at the device's bandwidths (latency not included)."""
        up = _number("bytes_up", bytes_up, allow_zero=True)
        down = _number("bytes_down", bytes_down, allow_zero=True)
        return 8.0 * up / self.up_bps + 8.0 * down / self.down_bps

    # --- records ---

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> DeviceTrace:
        """Build from one JSON object; unknown or missing fields are errors naming the field."""
        known = [f.name for f in fields(cls) if f.init]
        for name in record:
            if name not in known:
                raise TraceFieldError(name, f"unknown field (known: {', '.join(known)})")
        for name in ("device_id", "device_class", "memory_budget_bytes", "up_bps", "down_bps", "latency_s"):
            if name not in record:
                raise TraceFieldError(name, "missing")
        return cls(**record)

    def to_record(self) -> dict[str, Any]:
        """The JSON object of this trace, leaving out empty optional fields."""
        record: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.init and value not in (None, ()):
                record[f.name] = [list(pair) for pair in value] if isinstance(value, tuple) else value
        return record


def _merge(windows: Iterable[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Sorted, merged windows; touching closed windows form one stretch."""
    starts: list[float] = []
    ends: list[float] = []
    for start, end in sorted(windows):
        if ends and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    return starts, ends


_COLUMNS = [f.name for f in fields(DeviceTrace) if f.init]
_JSON_COLUMNS = {"block_latency_s", "availability", "budget_schedule", "origin"}
_TEXT_COLUMNS = {"device_id", "device_class"}


def _format_of(path: Path) -> str:
    if path.suffix in (".jsonl", ".json"):
        return "jsonl"
    if path.suffix == ".csv":
        return "csv"
    raise ConfigError(f"[trace] {path}: unknown trace format '{path.suffix}' (use .jsonl or .csv)")


def _csv_record(row: dict[str | None, str | None]) -> dict[str, Any]:
    if None in row:
        raise ConfigError("more cells than header columns")
    record: dict[str, Any] = {}
    for name, cell in row.items():
        if cell is None or cell == "" or name is None:
            continue
        if name in _TEXT_COLUMNS or name not in _COLUMNS:
            record[name] = cell
            continue
        try:
            record[name] = json.loads(cell)
        except json.JSONDecodeError:
            raise TraceFieldError(name, f"not a number or JSON value: {cell!r}") from None
    return record


def _records(path: Path) -> Iterable[tuple[int, dict[str, Any]]]:
    """(line number, raw record) pairs; a line that is not a record raises naming its line."""
    is_csv = _format_of(path) == "csv"
    with path.open(newline="" if is_csv else None, encoding="utf-8") as stream:
        if is_csv:
            reader = csv.DictReader(stream)
            for row in reader:
                try:
                    yield reader.line_num, _csv_record(row)
                except ConfigError as error:
                    raise ConfigError(f"[trace] {path}:{reader.line_num}: {error}") from None
            return
        for line_number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(
                    f"[trace] {path}:{line_number}: not valid JSON ({error.msg}, column {error.colno})"
                ) from None
            if not isinstance(record, dict):
                raise ConfigError(f"[trace] {path}:{line_number}: expected one JSON object per line")
            yield line_number, record


def load_traces(path: str | Path) -> list[DeviceTrace]:
    """Read a JSONL or CSV trace; any bad value is a ConfigError naming file, line and field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"[trace] trace file not found: {path}")
    traces: list[DeviceTrace] = []
    first_line: dict[str, int] = {}
    for line_number, record in _records(path):
        try:
            trace = DeviceTrace.from_record(record)
        except ConfigError as error:
            device = record.get("device_id", "?")
            raise ConfigError(f"[trace] {path}:{line_number}: device '{device}': {error}") from None
        if trace.device_id in first_line:
            raise ConfigError(
                f"[trace] {path}:{line_number}: device_id '{trace.device_id}' already used on line "
                f"{first_line[trace.device_id]}"
            )
        first_line[trace.device_id] = line_number
        traces.append(trace)
    if not traces:
        raise ConfigError(f"[trace] {path}: no devices in the file")
    return traces


def save_traces(traces: Iterable[DeviceTrace], path: str | Path) -> None:
    """Write traces as JSONL or CSV (chosen by the file suffix)."""
    path = Path(path)
    records = [trace.to_record() for trace in traces]
    with path.open("w", newline="", encoding="utf-8") as stream:
        if _format_of(path) == "jsonl":
            stream.writelines(strict_dumps(record, separators=(",", ":")) + "\n" for record in records)
            return
        writer = csv.DictWriter(stream, fieldnames=_COLUMNS)
        writer.writeheader()
        for record in records:
            writer.writerow(
                {
                    name: json.dumps(value) if name in _JSON_COLUMNS else value
                    for name, value in record.items()
                }
            )


def time_scaled(trace: DeviceTrace, factor: float) -> DeviceTrace:
    """The trace with its clock run `factor` times faster: availability windows, period and budget changes
    at t / factor; speeds and links unchanged (a day of churn replayed in minutes by the same boards)."""
    factor = _number("time scale", factor)
    if factor == 1.0:
        return trace
    record = trace.to_record()
    if trace.availability:
        record["availability"] = [[start / factor, end / factor] for start, end in trace.availability]
    if trace.period_s is not None:
        record["period_s"] = trace.period_s / factor
    if trace.budget_schedule:
        record["budget_schedule"] = [[t / factor, budget] for t, budget in trace.budget_schedule]
    return DeviceTrace.from_record(record)
