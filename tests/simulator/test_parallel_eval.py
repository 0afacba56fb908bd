"""A pool's workers score a round's submodels exactly as the coordinator would, in the targets' order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nestling.config import config_from_dict
from nestling.simulator.backend import ProcessPoolBackend
from nestling.simulator.run import run_simulation


def scores(tmp_path: Path, name: str, method: dict, backend: str, workers: int) -> list[list[tuple]]:
    cfg = config_from_dict(
        {
            "run": {
                "rounds": 2,
                "eval_every": 1,
                "workers": workers,
                "backend": backend,
                "calibration_samples": 200,
            },
            "data": {"dataset": "digits", "clients": 6, "limit_train": 400, "limit_test": 150},
            "model": {"arch": "tinycnn"},
            "method": method,
            "train": {"fraction": 0.5, "local_steps": 3, "batch_size": 16},
        }
    )
    run_simulation(cfg, tmp_path / name)
    rounds = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [
        [(s["name"], s["accuracy"], s["loss"], s["parameters"], s["macs"]) for s in r["submodels"]]
        for r in rounds
    ]


def test_pool_workers_score_every_submodel_as_the_coordinator_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HeteroFL with sBN: each worker calibrates every width on the same images as the coordinator would."""
    method = {"name": "heterofl", "options": {"static_bn": True}}
    serial = scores(tmp_path, "inprocess", method, "inprocess", 1)
    scored_by_workers: list[int] = []
    make_runner = ProcessPoolBackend.evaluation_runner

    def counting(self: ProcessPoolBackend, factory: Any, args: dict[str, Any]) -> Any:
        runner = make_runner(self, factory, args)
        return lambda targets: scored_by_workers.append(len(targets)) or runner(targets)

    monkeypatch.setattr(ProcessPoolBackend, "evaluation_runner", counting)
    pooled = scores(tmp_path, "pool", method, "pool", 2)
    assert len(serial) == 2 and all(len(r) > 1 for r in serial)
    assert scored_by_workers == [len(r) for r in serial]  # every round's targets went to the workers
    assert pooled == serial
