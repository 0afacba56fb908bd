"""Bookkeeping at fleet scale: a 10,000-device synthetic trace, 100 devices a round, 5 rounds of the tiny CNN.

Goal (issue 6): under 10 minutes on this 2-core machine. The trace is generated from the board
catalogue (diurnal availability, seeded); `digits` is split into 100 partitions that the 10,000
devices share (device i trains on partition i mod 100). Ends with one line
`devices=… rounds=… wall_s=… virtual_s=… dropouts=… under_10_min=…`.
Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scale_10k.py
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from nestling.config import config_from_dict
from nestling.profiler.traces import save_traces
from nestling.simulator.generate import DEFAULT_MIX, generate_fleet
from nestling.simulator.run import run_simulation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--method", default="nefl-wd")
    parser.add_argument("--out", type=Path, help="keep the run (metrics, timeline, report) here")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        out = a.out or Path(scratch) / "run"
        started = time.perf_counter()
        traces = Path(scratch) / "fleet.jsonl"
        save_traces(generate_fleet(DEFAULT_MIX, a.devices, seed=7), traces)
        generated = time.perf_counter() - started
        cfg = config_from_dict(
            {
                "run": {
                    "rounds": a.rounds,
                    "eval_every": a.rounds,
                    "traces": str(traces),
                    "over_selection": 1.3,
                    "deadline_s": 1800.0,
                    "checkpoint_every": a.rounds,
                },
                "data": {"dataset": "digits", "clients": 100},
                "model": {"arch": "tinycnn"},
                "method": {"name": a.method},
                "train": {"fraction": a.per_round / a.devices, "local_epochs": 1, "batch_size": 16},
            }
        )
        summary = run_simulation(cfg, out, overwrite=True)
        wall = time.perf_counter() - started
    replay = summary["replay"]
    outcomes = replay["outcomes"]
    print(
        f"trace: {replay['devices']} devices in {len(replay['device_classes'])} classes, "
        f"generated in {generated:.1f} s"
    )
    print(
        f"tasks: {replay['tasks']} dispatched, {outcomes.get('used', 0)} used, "
        f"{outcomes.get('dropped', 0)} dropped, "
        f"{outcomes.get('cancelled', 0)} cancelled; worst accuracy {summary['worst_accuracy']:.3f}"
    )
    print(
        f"devices={replay['devices']} rounds={summary['rounds']} wall_s={wall:.1f} "
        f"virtual_s={summary['virtual_seconds']:.1f} dropouts={outcomes.get('dropped', 0)} "
        f"under_10_min={wall < 600}"
    )


if __name__ == "__main__":
    main()
