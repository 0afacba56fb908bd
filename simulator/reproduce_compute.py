"""What each method's boards computed in a reproduction: optimizer steps and training MACs per client-round.

An observer of every result a simulated board trained (`run_simulation(observers=...)`, read-only) appends one
line per client-round to the run folder's compute.jsonl: the steps the board reported taking and
its training MACs by the profiler's rule, 3 × forward MACs of the task's model × samples pushed through it
(× models, for m-FeDepth's boards that train two). That rule is exact for plain, width- and depth-sliced
training; it over-counts FeDepth's stages (a stage's step runs forward through its frozen prefix and backward
only through the stage) and under-counts DynamicFL's on-board branches (the task's model is the plain one).
A resumed run rewrites the rounds it repeats, so each (round, board) counts once.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from nestling.messages import Result, Task
from nestling.strict_json import strict_dumps

COMPUTE_FILE = "compute.jsonl"


class ComputeMeter:
    """Records every trained result's steps and training MACs (a simulator result observer)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / COMPUTE_FILE
        self._counters: dict[tuple[int, ...], Any] = {}

    def __call__(self, task: Task, result: Result) -> None:
        from nestling.profiler.speed import TRAIN_OVER_FORWARD, MacCounter, samples_trained
        from nestling.spec import SubmodelSpec

        spec = SubmodelSpec.from_dict(task.spec)
        shape = (spec.model.in_channels, spec.model.image_size, spec.model.image_size)
        counter = self._counters.setdefault(shape, MacCounter(shape))
        steps = result.metrics.get("steps")
        steps = int(steps) if isinstance(steps, (int, float)) and not isinstance(steps, bool) else 0
        models = result.metrics.get("models", 1)
        models = int(models) if isinstance(models, int) and not isinstance(models, bool) and models > 0 else 1
        samples = samples_trained({**task.hparams, "local_steps": steps}, result.num_samples)
        row = {
            "round": task.round,
            "device": task.device_id,
            "steps": steps,
            "macs": float(counter(spec)) * TRAIN_OVER_FORWARD * samples * models,
        }
        with self.path.open("a") as handle:
            handle.write(strict_dumps(row) + "\n")


def read_compute(run_dir: Path) -> dict[str, float]:
    """Per client-round: mean, min and max steps and training MACs, and how many client-rounds were counted
    (empty for a run made before compute was recorded)."""
    path = run_dir / COMPUTE_FILE
    if not path.is_file():
        return {}
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[(int(row["round"]), str(row["device"]))] = row  # a resumed round overwrites its first try
    if not rows:
        return {}
    steps = [float(r["steps"]) for r in rows.values()]
    macs = [float(r["macs"]) for r in rows.values()]
    return {
        "client_rounds": float(len(rows)),
        "steps_mean": statistics.fmean(steps),
        "steps_min": min(steps),
        "steps_max": max(steps),
        "macs_mean": statistics.fmean(macs),
        "macs_min": min(macs),
        "macs_max": max(macs),
    }
