"""A small trace fleet and the replay config the server-time and transport-time tests run it with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nestling.config import SimConfig, config_from_dict
from nestling.profiler.traces import DeviceTrace, save_traces


def trace(name: str, gflops: float, **overrides: Any) -> DeviceTrace:
    """An always-online rpi4-class board of `gflops`, 1 MB/s each way; `overrides` change any field."""
    fields: dict[str, Any] = {
        "device_id": name,
        "device_class": "rpi4",
        "memory_budget_bytes": 2**30,
        "up_bps": 1e6,
        "down_bps": 1e6,
        "latency_s": 0.01,
        "gflops": gflops,
    }
    return DeviceTrace(**{**fields, **overrides})


def replay_config(
    tmp_path: Path, traces: list[DeviceTrace], *, rounds: int, fraction: float = 1.0, **run: Any
) -> SimConfig:
    """FedAvg on tinycnn and 120 digits, one local step, replaying `traces`; `run` adds [run] settings."""
    path = tmp_path / "fleet.jsonl"
    save_traces(traces, path)
    return config_from_dict(
        {
            "run": {"rounds": rounds, "eval_every": 1, "workers": 1, "traces": str(path), **run},
            "data": {"dataset": "digits", "clients": len(traces), "limit_train": 120, "limit_test": 60},
            "model": {"arch": "tinycnn"},
            "method": {"name": "fedavg"},
            "train": {"fraction": fraction, "local_steps": 1, "batch_size": 16},
        }
    )
