"""docs/extending.md's method example runs as written: FedProx registers, trains in `simulate` and exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nestling.edge.procedures import is_batchable, unregister_procedure
from nestling.server.strategies import STRATEGIES

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "extending.md"


def _method_section() -> str:
    text = GUIDE.read_text()
    start = text.index("## Adding a method")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


@pytest.fixture
def namespace(tmp_path: Path) -> Iterator[dict[str, Any]]:
    scope: dict[str, Any] = {"run_dir": tmp_path / "run"}
    yield scope
    STRATEGIES.pop("fedprox", None)
    unregister_procedure("fedprox")


def test_the_method_example_trains_in_simulate_and_exports(namespace: dict[str, Any], tmp_path: Path) -> None:
    from nestling.checkpoint_io import latest_checkpoint, load_checkpoint
    from nestling.export.options import ExportOptions
    from nestling.export.pipeline import export_submodel

    blocks = re.findall(r"```python\n(.*?)```", _method_section(), flags=re.S)
    assert len(blocks) == 2
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), namespace)  # the guide's own code
    assert STRATEGIES["fedprox"] is namespace["FedProx"] and not is_batchable("fedprox")
    summary = namespace["summary"]
    assert summary["rounds"] == 2 and 0.0 < summary["worst_accuracy"] <= 1.0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["accepted"] == 4 for r in records)

    # The proximal term does what it says: the same run with a strong mu ends nearer the initial model.
    from nestling.config import config_from_dict
    from nestling.server.strategies import create_strategy
    from nestling.simulator.run import run_simulation

    def moved(mu: float) -> float:
        cfg = config_from_dict({**namespace["cfg"].to_dict(), "method": {"name": "fedprox", "mu": mu}})
        run_simulation(cfg, tmp_path / f"mu-{mu}")
        state, _ = load_checkpoint(latest_checkpoint(tmp_path / f"mu-{mu}" / "checkpoints"))
        start = create_strategy("fedavg", _context(cfg)).global_state
        return sum(
            float((state[f"global/{k}"] - v).norm())
            for k, v in start.items()
            if v.is_floating_point() and "running_" not in k
        )

    assert moved(10.0) < 0.7 * moved(0.0)  # 3 local steps: the pull acts from the second step on

    checkpoint = latest_checkpoint(tmp_path / "run" / "checkpoints")
    report = export_submodel(
        checkpoint,
        tmp_path / "bundle",
        level=1,
        data="digits",
        options=ExportOptions(benchmark=False, calib_samples=64, eval_samples=64),
    )
    assert (tmp_path / "bundle").is_dir() and "parity" in json.dumps(report, default=str)


def _context(cfg: Any) -> Any:
    from nestling.server.strategies import StrategyContext

    return StrategyContext(
        arch=cfg.model.arch,
        num_classes=10,
        in_channels=1,
        image_size=8,
        num_clients=4,
        total_rounds=2,
        seed=cfg.run.seed,
    )
