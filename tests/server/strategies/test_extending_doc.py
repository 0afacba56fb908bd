"""docs/extending.md's method example runs as written: its FedProx registers, trains in `simulate` and exports.

The guide's code runs under names of this test's own (never a built-in's, now or later), and every registry it
touches is put back as it was: a method a later release ships under the guide's name is neither replaced nor
deleted by this test.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nestling.edge.procedures import (
    is_batchable,
    known_procedures,
    params_for,
    restore_procedures,
    snapshot_procedures,
)
from nestling.models.family import registered_families
from nestling.server.strategies import STRATEGIES, restore_strategies, snapshot_strategies

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "extending.md"
DOC_NAME = "lab-fedprox"  # the name the guide registers its method and procedure under


def _method_section() -> str:
    text = GUIDE.read_text()
    start = text.index("## Adding a method")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _guide_code(name: str) -> list[str]:
    """The section's python blocks with the guide's method name replaced by `name` (nothing else changed)."""
    blocks = re.findall(r"```python\n(.*?)```", _method_section(), flags=re.S)
    assert len(blocks) == 2
    assert all(block.count(f'"{DOC_NAME}"') for block in blocks)  # the substitution below has work to do
    return [block.replace(f'"{DOC_NAME}"', f'"{name}"') for block in blocks]


@pytest.fixture
def registries() -> Iterator[None]:
    """Snapshot the strategy and procedure registries; restore them afterwards and check they are as found."""
    strategies, procedures = snapshot_strategies(), snapshot_procedures()
    families = set(registered_families())
    yield
    restore_strategies(strategies)
    restore_procedures(procedures)
    assert snapshot_strategies() == strategies and snapshot_procedures() == procedures
    assert set(registered_families()) == families


@pytest.fixture
def name() -> str:
    """A method name no built-in has or will have: the guide's, made unique to this test run."""
    unique = f"test-{DOC_NAME}-{uuid.uuid4().hex[:8]}"
    assert unique not in STRATEGIES and unique not in known_procedures()
    return unique


def test_the_guide_uses_a_name_no_built_in_has() -> None:
    assert DOC_NAME not in STRATEGIES and DOC_NAME not in known_procedures()


def test_running_the_guide_twice_is_refused_not_replaced(registries: None, name: str) -> None:
    """A second class under a taken name is an error: a plugin cannot silently replace a built-in."""
    from nestling.errors import ConfigError

    scope: dict[str, Any] = {}
    exec(compile(_guide_code(name)[0], str(GUIDE), "exec"), scope)
    with pytest.raises(ConfigError, match="registered twice"):
        exec(compile(_guide_code(name)[0], str(GUIDE), "exec"), {})
    assert STRATEGIES[name] is scope["FedProx"]


def test_the_method_example_trains_in_simulate_and_exports(
    registries: None, name: str, tmp_path: Path
) -> None:
    from nestling.checkpoint_io import latest_checkpoint, load_checkpoint
    from nestling.export.options import ExportOptions
    from nestling.export.pipeline import export_submodel

    namespace: dict[str, Any] = {"run_dir": tmp_path / "run"}
    for block in _guide_code(name):
        exec(compile(block, str(GUIDE), "exec"), namespace)  # the guide's own code
    assert STRATEGIES[name] is namespace["FedProx"] and not is_batchable(name)
    assert params_for(name) is namespace["FedProxParams"]
    summary = namespace["summary"]
    assert summary["rounds"] == 2 and 0.0 < summary["worst_accuracy"] <= 1.0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["accepted"] == 4 for r in records)

    # The proximal term does what it says: the same run with a strong mu ends nearer the initial model.
    from nestling.config import config_from_dict
    from nestling.server.strategies import create_strategy
    from nestling.simulator.run import run_simulation

    def moved(mu: float) -> float:
        cfg = config_from_dict({**namespace["cfg"].to_dict(), "method": {"name": name, "mu": mu}})
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
