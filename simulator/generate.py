"""Synthetic fleets drawn from the board catalogue: a class mix, per-device spread, diurnal availability.

Everything here is synthetic and seeded (DEVICES.md §4: label such traces as synthetic). Each device
varies log-normally around its class figures, the median being the catalogue value.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nestling.cli_numbers import non_negative_int, positive_int
from nestling.errors import ConfigError
from nestling.profiler.catalogue import BOARDS, get_board
from nestling.profiler.traces import DeviceTrace, save_traces

DAY_S = 86400.0
HOUR_S = 3600.0

# Default fleet: mostly Pis, Jetson Nanos and phones, a few big boards and laptops.
DEFAULT_MIX: Mapping[str, float] = {
    "rpi4": 0.20,
    "rpi5": 0.10,
    "jetson-nano": 0.15,
    "jetson-xavier-nx": 0.05,
    "jetson-orin-nano": 0.10,
    "jetson-agx-orin": 0.02,
    "phone-low": 0.13,
    "phone-mid": 0.15,
    "phone-high": 0.05,
    "laptop": 0.05,
}

# Log-normal sigmas of the per-device spread (assumptions). Compute: power modes, thermals and
# background load; FedScale/Oort report ~10x compute spread across a whole phone population
# (DEVICES.md §4), far more than within one class. Links: one shared quality factor per device
# (its access network) plus a smaller per-direction one; crowd-sourced Wi-Fi and cell throughput
# "vary widely" (Sommers & Barford, IMC 2012).
COMPUTE_SIGMA = 0.25
BUDGET_SIGMA = 0.10
LINK_SIGMA = 0.5
DIRECTION_SIGMA = 0.25
LATENCY_SIGMA = 0.4


@dataclass(frozen=True)
class DailyPattern:
    """When devices of one kind are online each day: one window, or always on for a share of them."""

    always_on_share: float
    start_hour: float
    start_sd_hours: float
    length_hours: float
    length_sd_hours: float


# Assumptions. Phones: online while charging, mostly at night (FLASH, FedScale's availability
# source, DEVICES.md §4). Boards: most are dedicated and always on; the rest train from the
# evening after daytime duty. Laptops: working hours.
DAILY_PATTERNS: Mapping[str, DailyPattern] = {
    "phone": DailyPattern(0.0, start_hour=22.5, start_sd_hours=1.5, length_hours=8.0, length_sd_hours=1.5),
    "board": DailyPattern(0.7, start_hour=19.0, start_sd_hours=2.0, length_hours=12.0, length_sd_hours=2.0),
    "laptop": DailyPattern(0.0, start_hour=9.0, start_sd_hours=1.0, length_hours=8.0, length_sd_hours=1.5),
}
_SHORTEST_WINDOW_S = 1.0 * HOUR_S
_FOREVER_S = 1e12  # the last window of a churning device: online from then on
_LONGEST_WINDOW_S = 23.0 * HOUR_S


def _weight(name: str, weight: object) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
        raise ConfigError(f"[fleet] weight of '{name}' must be a positive number, got {weight!r}")
    return float(weight)


def parse_mix(mix: str | Mapping[str, float] | None) -> dict[str, float]:
    """Class weights, normalised to sum to 1, from "rpi4:0.4,phone-mid:0.6" or a mapping (None: default)."""
    if mix is None or (isinstance(mix, str) and not mix.strip()):
        mix = DEFAULT_MIX
    if isinstance(mix, str):
        pairs: dict[str, float] = {}
        for part in mix.split(","):
            name, _, weight = (piece.strip() for piece in part.partition(":"))
            try:
                value = float(weight)
            except ValueError:
                raise ConfigError(f"[fleet] '{part.strip()}' is not CLASS:WEIGHT (e.g. rpi4:0.4)") from None
            if name in pairs:
                raise ConfigError(f"[fleet] class '{name}' appears twice in the fleet mix")
            pairs[name] = value
        mix = pairs
    for name in mix:
        get_board(name)  # unknown class: ConfigError listing the known ones
    weights = {name: _weight(name, weight) for name, weight in mix.items()}
    total = sum(weights.values())
    return {name: weight / total for name, weight in weights.items()}


def _class_counts(weights: Sequence[float], n_devices: int) -> list[int]:
    """Devices per class, exact to one device (largest remainder), so proportions do not drift."""
    quotas = [w * n_devices for w in weights]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: counts[i] - quotas[i])
    for i in by_remainder[: n_devices - sum(counts)]:
        counts[i] += 1
    return counts


def _daily_windows(start_s: float, length_s: float) -> tuple[tuple[float, float], ...]:
    end_s = start_s + length_s
    if end_s <= DAY_S:
        return ((start_s, end_s),)
    return ((0.0, end_s - DAY_S), (start_s, DAY_S))


def generate_fleet(
    mix: str | Mapping[str, float] | None, n_devices: int, seed: int, diurnal: bool = True
) -> list[DeviceTrace]:
    """`n_devices` seeded synthetic traces in the given class proportions (None: DEFAULT_MIX)."""
    if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
        raise ConfigError(f"[fleet] number of devices must be a positive integer, got {n_devices!r}")
    weights = parse_mix(mix)
    boards = [BOARDS[name] for name in weights]
    rng = np.random.default_rng(seed)
    class_of = np.repeat(np.arange(len(boards)), _class_counts(list(weights.values()), n_devices))
    rng.shuffle(class_of)

    def per_device(values: list[float]) -> np.ndarray:
        return np.asarray(values, dtype=float)[class_of]

    gflops = per_device([b.sustained_gflops for b in boards]) * rng.lognormal(0.0, COMPUTE_SIGMA, n_devices)
    budget = np.minimum(
        per_device([b.memory_budget_bytes for b in boards]) * rng.lognormal(0.0, BUDGET_SIGMA, n_devices),
        per_device([b.ram_bytes for b in boards]),
    )
    link = rng.lognormal(0.0, LINK_SIGMA, n_devices)
    down = per_device([b.down_bps for b in boards]) * link * rng.lognormal(0.0, DIRECTION_SIGMA, n_devices)
    up = per_device([b.up_bps for b in boards]) * link * rng.lognormal(0.0, DIRECTION_SIGMA, n_devices)
    latency = per_device([b.latency_s for b in boards]) * rng.lognormal(0.0, LATENCY_SIGMA, n_devices)

    patterns = [DAILY_PATTERNS[b.kind] for b in boards]
    always_on = rng.random(n_devices) < per_device([p.always_on_share for p in patterns])
    starts = rng.normal(
        per_device([p.start_hour for p in patterns]), per_device([p.start_sd_hours for p in patterns])
    )
    lengths = rng.normal(
        per_device([p.length_hours for p in patterns]), per_device([p.length_sd_hours for p in patterns])
    )
    starts_s = np.mod(np.round(starts * HOUR_S), DAY_S)
    lengths_s = np.round(np.clip(lengths * HOUR_S, _SHORTEST_WINDOW_S, _LONGEST_WINDOW_S))

    width = len(str(n_devices - 1))
    traces = []
    for i in range(n_devices):
        board = boards[class_of[i]]
        windows = (
            () if not diurnal or always_on[i] else _daily_windows(float(starts_s[i]), float(lengths_s[i]))
        )
        traces.append(
            DeviceTrace(
                device_id=f"{board.name}-{i:0{width}d}",
                device_class=board.name,
                memory_budget_bytes=int(budget[i]),
                up_bps=round(float(up[i])),
                down_bps=round(float(down[i])),
                latency_s=round(float(latency[i]), 4),
                gflops=round(float(gflops[i]), 3),
                availability=windows,
                period_s=DAY_S if windows else None,
            )
        )
    return traces


def traces_generate_main(argv: Sequence[str] | None = None) -> int:
    """`nestling traces generate`: sample a synthetic fleet from the catalogue into a trace file."""
    parser = argparse.ArgumentParser(
        prog="nestling traces generate",
        description="Sample a synthetic fleet trace from the board catalogue.",
    )
    parser.add_argument(
        "--fleet",
        default=None,
        metavar="SPEC",
        help="class mix like rpi4:0.4,jetson-nano:0.3,phone-mid:0.3 "
        f"(default: a mix of all classes; known: {', '.join(BOARDS)})",
    )
    parser.add_argument("--devices", type=positive_int, required=True, metavar="N", help="number of devices")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", type=Path, required=True, help="trace file to write (.jsonl or .csv)")
    parser.add_argument(
        "--diurnal",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="daily availability windows (--no-diurnal: every device always on)",
    )
    args = parser.parse_args(argv)
    traces = generate_fleet(args.fleet, args.devices, args.seed, diurnal=args.diurnal)
    save_traces(traces, args.out)
    counts: dict[str, int] = {}
    for trace in traces:
        counts[trace.device_class] = counts.get(trace.device_class, 0) + 1
    summary = ", ".join(f"{name}: {count}" for name, count in counts.items())
    print(f"wrote {len(traces)} synthetic devices ({summary}) to {args.out}")
    return 0


def with_sessions(
    traces: Sequence[DeviceTrace],
    share: float,
    mean_online_s: float,
    mean_offline_s: float,
    horizon_s: float,
    seed: int,
) -> list[DeviceTrace]:
    """Churn: a seeded `share` of the devices alternate online and offline sessions of exponential lengths
    (means given, in trace seconds) up to `horizon_s`, then stay online; the others keep their windows.

    Every churning device starts online, so a fleet whose agents all register before its first round
    meets the trace at t = 0 (the emulated agents take their trace clock from that round's start)."""
    if not 0.0 <= share <= 1.0:
        raise ConfigError(f"[fleet] churn share must lie in [0, 1], got {share!r}")
    for name, value in (("mean_online_s", mean_online_s), ("mean_offline_s", mean_offline_s)):
        if not value > 0:
            raise ConfigError(f"[fleet] churn {name} must be > 0, got {value!r}")
    rng = np.random.default_rng(seed)
    churning = set(rng.permutation(len(traces))[: round(share * len(traces))].tolist())
    out = []
    for i, trace in enumerate(traces):
        if i not in churning:
            out.append(trace)
            continue
        windows: list[tuple[float, float]] = []
        t = 0.0
        while True:
            end = t + float(rng.exponential(mean_online_s))
            if end >= horizon_s:
                windows.append((round(t, 3), _FOREVER_S))
                break
            windows.append((round(t, 3), round(end, 3)))
            t = end + float(rng.exponential(mean_offline_s))
            if t >= horizon_s:
                windows.append((round(t, 3), _FOREVER_S))
                break
        record = {**trace.to_record(), "availability": [list(w) for w in windows]}
        record.pop("period_s", None)
        out.append(DeviceTrace.from_record(record))
    return out
