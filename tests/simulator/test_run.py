"""`nestling simulate` plans as `nestling server` does: a replayed board is sized by its trace's profile, and the
round deadline's training share ([run] deadline_s × train_share) limits what a slow class trains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nestling.config import SimConfig, config_from_dict
from nestling.profiler.traces import DeviceTrace, save_traces
from nestling.server.run_setup import strategy_for_run
from nestling.simulator.run import run_simulation

# tinycnn on 16x16 digits, 2 local steps of 16 samples: the full model takes a 4 MFLOP/s board ~26 s, width
# 0.5 ~6.7 s, width 0.25 ~1.8 s; a 1 GFLOP/s board trains the full model in ~0.1 s. Memory fits everything.
FAST_GFLOPS, SLOW_GFLOPS = 1.0, 0.004


def trace(name: str, cls: str, gflops: float) -> DeviceTrace:
    return DeviceTrace(name, cls, 2**30, 1e7, 1e7, 0.01, gflops=gflops)


def config(tmp_path: Path, **run: Any) -> SimConfig:
    path = tmp_path / "fleet.jsonl"
    fleet = [
        trace(f"t{i}", *(("fast", FAST_GFLOPS) if i % 2 == 0 else ("slow", SLOW_GFLOPS))) for i in range(4)
    ]
    save_traces(fleet, path)
    return config_from_dict(
        {
            "run": {
                "rounds": 1,
                "eval_every": 1,
                "workers": 1,
                "traces": str(path),
                "checkpoint_every": 0,
                **run,
            },
            "data": {"dataset": "digits", "clients": 4, "limit_train": 200, "limit_test": 50},
            "model": {"arch": "tinycnn"},
            "method": {"name": "heterofl"},
            "train": {"fraction": 1.0, "local_steps": 2, "batch_size": 16},
        }
    )


def widths(cfg: SimConfig, out: Path) -> dict[str, float]:
    """Device class → the HeteroFL width its boards trained (every board of a class trains the same here)."""
    strategy = strategy_for_run(cfg, num_classes=10, input_shape=(1, 16, 16), num_clients=4, dataset="digits")
    width = {spec.id: rate for rate, spec in strategy.specs.items()}  # type: ignore[attr-defined]
    plans = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["plans"]
    found: dict[str, set[float]] = {}
    for line in (out / "timeline.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert plans[row["device_id"]]["spec"] == row["spec_id"]  # planned from its trace's profile
        found.setdefault(row["device_class"], set()).add(width[row["spec_id"]])
    assert all(len(w) == 1 for w in found.values()), found
    return {cls: w.pop() for cls, w in found.items()}


def test_a_deadline_gives_a_slow_class_a_smaller_submodel_than_no_deadline(tmp_path: Path) -> None:
    free_cfg, timed_cfg = config(tmp_path), config(tmp_path, deadline_s=5.0, train_share=0.7)
    run_simulation(free_cfg, tmp_path / "free")
    run_simulation(timed_cfg, tmp_path / "timed")
    free, timed = widths(free_cfg, tmp_path / "free"), widths(timed_cfg, tmp_path / "timed")
    assert free == {"fast": 1.0, "slow": 1.0}  # memory alone: everyone trains the full model
    assert timed["fast"] == 1.0 and timed["slow"] == 0.25  # 3.5 s of training: 0.5 (6.7 s) would miss it
    plans = json.loads((tmp_path / "timed" / "metrics.jsonl").read_text().splitlines()[0])["plans"]
    slow = [p for d, p in plans.items() if int(d[-1]) % 2 == 1]
    assert all(p["reason"] == "time-bound" and p["time_budget_s"] == 3.5 for p in slow)
    assert all(p["predicted_s"] <= 3.5 for p in plans.values())
