"""`--backend ray`: the same results as in-process for the same seed, and a clear error without ray."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nestling.config import config_from_dict
from nestling.errors import DependencyError
from nestling.profiler.traces import DeviceTrace, save_traces
from nestling.server.checkpoint import latest_checkpoint, load_checkpoint
from nestling.simulator.fleetdata import client_provider
from nestling.simulator.run import run_simulation


def test_without_ray_the_backend_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from nestling.simulator.ray_backend import RayBackend

    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` fail as if it were not installed
    with pytest.raises(DependencyError, match=r"--backend ray needs ray: pip install nestling\[ray\]"):
        RayBackend(client_provider, {}, workers=1)


def run(tmp_path: Path, name: str, backend: str, workers: int) -> dict[str, torch.Tensor]:
    traces = tmp_path / "fleet.jsonl"
    save_traces(
        [DeviceTrace(f"t{i}", "rpi4", 2**30, 1e6, 1e6, 0.01, gflops=0.05 * (i + 1)) for i in range(6)], traces
    )
    cfg = config_from_dict(
        {
            "run": {
                "rounds": 2,
                "eval_every": 2,
                "workers": workers,
                "backend": backend,
                "traces": str(traces),
                "over_selection": 1.5,
            },
            "data": {"dataset": "digits", "clients": 6, "limit_train": 300, "limit_test": 100},
            "model": {"arch": "tinycnn"},
            "method": {"name": "nefl-wd"},
            "train": {"fraction": 0.5, "local_steps": 3, "batch_size": 16},
        }
    )
    out = tmp_path / name
    run_simulation(cfg, out)
    checkpoint = latest_checkpoint(out / "checkpoints")
    assert checkpoint is not None
    return load_checkpoint(checkpoint)[0]


@pytest.mark.slow  # ray is an optional extra; starting its runtime takes ~25 s of a 2-core box
def test_ray_trains_exactly_what_in_process_trains(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    local = run(tmp_path, "inprocess", "inprocess", workers=1)
    remote = run(tmp_path, "ray", "ray", workers=2)
    assert local.keys() == remote.keys()
    for key in local:
        assert torch.equal(local[key], remote[key]), key
