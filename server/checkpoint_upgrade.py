"""`nestling upgrade-checkpoint RUN_DIR`: describe the submodels of checkpoints written before they did.

Older checkpoints hold only the strategy's state; the strategy that wrote them is re-created here (the server
may do that; export and boards may not) and asked for its deployables, which are written beside the state.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from nestling.checkpoint_io import DEPLOYABLES, latest_checkpoint, load_checkpoint
from nestling.errors import ConfigError
from nestling.hashing import sha256_file
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.strict_json import strict_dumps


def context_from_manifest(manifest: dict[str, Any]) -> StrategyContext:
    """The run's StrategyContext; checkpoints written before the manifest kept it fall back to the model."""
    if "context" in manifest:
        return StrategyContext.from_record(manifest["context"])
    model = manifest.get("model")
    if not isinstance(model, dict):
        raise ConfigError(
            "checkpoint manifest has neither 'context' nor 'model': cannot rebuild its strategy"
        )
    return StrategyContext(
        arch=model["arch"],
        num_classes=int(model["num_classes"]),
        in_channels=int(model["in_channels"]),
        image_size=int(model["image_size"]),
        num_clients=1,
        total_rounds=1,
        model_extra=dict(model.get("extra", {})),
    )


def upgrade_checkpoint(folder: Path) -> bool:
    """Write the deployables of one `round-XXXXXX` folder; False when it already had them."""
    tensors, manifest = load_checkpoint(folder)
    if DEPLOYABLES in manifest and DEPLOYABLES in manifest.get("sides", {}):
        return False
    strategy = create_strategy(str(manifest.get("method")), context_from_manifest(manifest))
    if "model" in manifest and strategy.model.to_dict() != manifest["model"]:
        raise ConfigError(
            f"checkpoint {folder} was written for a different model than its method re-creates; "
            "its manifest lacks the run's method options"
        )
    strategy.load_state(tensors, manifest.get("strategy", {}))
    side, record = strategy.deployables()
    save_file(side, str(folder / f"{DEPLOYABLES}.safetensors"))
    manifest[DEPLOYABLES] = record
    manifest.setdefault("sides", {})[DEPLOYABLES] = sha256_file(folder / f"{DEPLOYABLES}.safetensors")
    staged = folder / "manifest.json.tmp"
    staged.write_text(strict_dumps(manifest, indent=1, sort_keys=True))
    os.replace(staged, folder / "manifest.json")
    return True


def checkpoint_folders(path: Path) -> list[Path]:
    """One round folder, or every round folder of a run or checkpoints folder."""
    if (path / "manifest.json").is_file():
        return [path]
    for root in (path / "checkpoints", path):
        folders = sorted(p for p in root.glob("round-*") if (p / "manifest.json").is_file())
        if folders:
            return folders
    if latest_checkpoint(path) is None:
        raise ConfigError(
            f"no checkpoint at {path} (expected round-XXXXXX/ with manifest.json, or a run folder)"
        )
    return []


def upgrade_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="nestling upgrade-checkpoint",
        description="Describe the deployable submodels of checkpoints written by an older Nestling.",
    )
    parser.add_argument("path", type=Path, help="a run folder, its checkpoints/ folder or one round-XXXXXX/")
    args = parser.parse_args(argv)
    for folder in checkpoint_folders(args.path):
        print(f"{folder}: {'described' if upgrade_checkpoint(folder) else 'already described'}")
    return 0
