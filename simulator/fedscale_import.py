"""Import FedScale's device traces (client_device_capacity, client_behave_trace) as DeviceTraces.

Units follow FedScale itself (SymbioticLab/FedScale, fedscale/cloud/internal/client_metadata.py
and fedscale/cloud/aggregation/aggregator.py); docs/traces.md shows the arithmetic:
- `computation` is inference latency in ms per sample; FedScale charges 3x that for training.
- `communication` is kbit/s with 1024-bit kbits (update size = bytes / 1024 * 8), one figure for
  both directions, and FedScale adds no latency.
- a client is online while active[i] <= (t mod finish_time) <= inactive[i].
"""

from __future__ import annotations

import argparse
import math
import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nestling.cli_numbers import positive_int
from nestling.errors import ConfigError
from nestling.profiler.catalogue import get_board
from nestling.profiler.traces import ANY_MODEL, DeviceTrace, save_traces

FEDSCALE_TRAINING_FACTOR = 3.0  # FedScale's augmentation_factor: backward ~ 2x forward
BITS_PER_KBIT = 1024.0  # FedScale counts update sizes as bytes / 1024 * 8
MS_PER_S = 1000.0
FEDSCALE_CLASS = "fedscale"
# FedScale's capacity trace only keeps devices with more than 2 GB RAM (DEVICES.md §4) and has no
# memory figure; the smallest phone class of the catalogue is the conservative stand-in.
DEFAULT_BUDGET_BOARD = "phone-low"


class _PlainDataUnpickler(pickle.Unpickler):
    """Unpickler that builds only what pickle opcodes build by themselves: no class, no callable."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"refused to load {module}.{name}: only plain dict/list/int/float/str data is accepted"
        )


def load_plain_pickle(path: str | Path) -> object:
    """Read a pickle holding plain data only; any class or callable in it is refused, never run."""
    path = Path(path)
    try:
        with path.open("rb") as stream:
            return _PlainDataUnpickler(stream).load()
    except FileNotFoundError:
        raise ConfigError(f"[fedscale] file not found: {path}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as error:
        raise ConfigError(f"[fedscale] {path}: not a plain-data FedScale pickle ({error})") from None


def _top_level_dict(path: str | Path) -> dict[Any, Any]:
    data = load_plain_pickle(path)
    if not isinstance(data, dict) or not data:
        raise ConfigError(
            f"[fedscale] {path}: expected a non-empty dict client_id -> entry, got {type(data).__name__}"
        )
    return data


def _positive(path: str | Path, client: object, key: str, entry: object) -> float:
    value = entry.get(key) if isinstance(entry, Mapping) else None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(
            f"[fedscale] {path}: client {client!r}: '{key}' must be a positive number, got {value!r}"
        )
    return float(value)


def _numbers(path: str | Path, client: object, key: str, entry: Mapping[str, Any]) -> list[float]:
    values = entry.get(key)
    if not isinstance(values, list) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
    ):
        raise ConfigError(f"[fedscale] {path}: client {client!r}: '{key}' must be a list of numbers")
    return [float(v) for v in values]


def _availability(path: str | Path, client: object, entry: object) -> tuple[list[tuple[float, float]], float]:
    """FedScale windows clipped to one period [0, finish_time], which is all its modulo ever sees."""
    if not isinstance(entry, Mapping):
        raise ConfigError(f"[fedscale] {path}: client {client!r}: entry must be a dict")
    period = _positive(path, client, "finish_time", entry)
    active = _numbers(path, client, "active", entry)
    inactive = _numbers(path, client, "inactive", entry)
    if not active or len(active) != len(inactive):
        raise ConfigError(
            f"[fedscale] {path}: client {client!r}: 'active' and 'inactive' must be equally long and "
            f"non-empty (got {len(active)} and {len(inactive)})"
        )
    windows = [
        (max(start, 0.0), min(end, period))
        for start, end in zip(active, inactive, strict=True)
        if max(start, 0.0) <= min(end, period)
    ]
    if not windows:
        raise ConfigError(f"[fedscale] {path}: client {client!r} is never online within finish_time {period}")
    return windows, period


def import_fedscale(
    capacity_path: str | Path,
    behave_path: str | Path | None = None,
    *,
    memory_budget_bytes: int | None = None,
) -> list[DeviceTrace]:
    """One DeviceTrace per client of `client_device_capacity`, online as `client_behave_trace` says.

    Pairing follows FedScale's client manager: client k takes the (k mod N)-th availability entry
    in file order, not the entry with key k. Without a behaviour file every device is always on.
    """
    capacities = _top_level_dict(capacity_path)
    behaviours = _top_level_dict(behave_path) if behave_path is not None else None
    behave_keys = list(behaviours) if behaviours is not None else []
    budget = (
        memory_budget_bytes
        if memory_budget_bytes is not None
        else get_board(DEFAULT_BUDGET_BOARD).memory_budget_bytes
    )
    traces = []
    for client, capacity in capacities.items():
        computation = _positive(capacity_path, client, "computation", capacity)
        communication = _positive(capacity_path, client, "communication", capacity)
        origin: dict[str, Any] = {
            "format": "fedscale",
            "client_id": client,
            "computation": capacity["computation"],
            "communication": capacity["communication"],
        }
        windows: list[tuple[float, float]] = []
        period = None
        if behaviours is not None and behave_path is not None:
            try:
                behave_key = behave_keys[int(client) % len(behave_keys)]
            except (TypeError, ValueError):
                raise ConfigError(
                    f"[fedscale] {capacity_path}: client id {client!r} is not an integer, so it cannot be "
                    "paired with client_behave_trace the way FedScale pairs them"
                ) from None
            windows, period = _availability(behave_path, behave_key, behaviours[behave_key])
            origin["behave_client_id"] = behave_key
        traces.append(
            DeviceTrace(
                device_id=str(client),
                device_class=FEDSCALE_CLASS,
                memory_budget_bytes=budget,
                up_bps=communication * BITS_PER_KBIT,
                down_bps=communication * BITS_PER_KBIT,
                latency_s=0.0,
                block_latency_s={ANY_MODEL: FEDSCALE_TRAINING_FACTOR * computation / MS_PER_S},
                availability=tuple(windows),
                period_s=period,
                origin=origin,
            )
        )
    return traces


def fedscale_capacity(trace: DeviceTrace) -> dict[str, float]:
    """This trace as a FedScale capacity entry; exactly the imported numbers while they still apply."""
    per_sample = (trace.block_latency_s or {}).get(ANY_MODEL)
    if per_sample is None:
        raise ConfigError(f"[fedscale] device '{trace.device_id}' has no model-free latency ('{ANY_MODEL}')")
    if trace.up_bps != trace.down_bps:
        raise ConfigError(f"[fedscale] device '{trace.device_id}': FedScale has one bandwidth, up != down")
    computation = per_sample * MS_PER_S / FEDSCALE_TRAINING_FACTOR
    origin = trace.origin or {}
    if origin.get("format") == "fedscale":
        # ms -> s loses the last bit now and then; the recorded figure is exact while it still maps here.
        recorded = origin.get("computation")
        if (
            isinstance(recorded, (int, float))
            and FEDSCALE_TRAINING_FACTOR * recorded / MS_PER_S == per_sample
        ):
            computation = recorded
    return {"computation": computation, "communication": trace.up_bps / BITS_PER_KBIT}


def export_fedscale_capacity(traces: Sequence[DeviceTrace]) -> dict[Any, dict[str, float]]:
    """A `client_device_capacity` dict for these traces, keyed by the original client ids when known."""
    return {(t.origin or {}).get("client_id", t.device_id): fedscale_capacity(t) for t in traces}


def traces_import_main(argv: Sequence[str] | None = None) -> int:
    """`nestling traces import`: convert FedScale pickles into a Nestling trace file."""
    parser = argparse.ArgumentParser(
        prog="nestling traces import",
        description="Convert FedScale device traces into a Nestling trace file.",
    )
    parser.add_argument("--capacity", required=True, type=Path, help="FedScale client_device_capacity pickle")
    parser.add_argument(
        "--behave", type=Path, help="FedScale client_behave_trace pickle (default: always on)"
    )
    parser.add_argument("--out", required=True, type=Path, help="trace file to write (.jsonl or .csv)")
    parser.add_argument(
        "--memory-budget",
        type=positive_int,
        metavar="BYTES",
        help=f"training memory budget per device (default: the {DEFAULT_BUDGET_BOARD} class budget)",
    )
    args = parser.parse_args(argv)
    traces = import_fedscale(args.capacity, args.behave, memory_budget_bytes=args.memory_budget)
    save_traces(traces, args.out)
    print(f"imported {len(traces)} FedScale devices into {args.out}")
    return 0
