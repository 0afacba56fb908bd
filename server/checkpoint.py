"""Atomic round checkpoints: `round-000123/` with `global.safetensors` + `manifest.json` (temp dir + rename).

The server writes checkpoints; reading them is kernel code (nestling.checkpoint_io) that export and boards share."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from nestling.checkpoint_io import (
    CHECKPOINT_FORMAT,
    DEPLOYABLES,
    latest_checkpoint,
    load_checkpoint,
    load_checkpoint_side,
)
from nestling.errors import ConfigError
from nestling.hashing import sha256_file
from nestling.server.strategies.base import Strategy
from nestling.strict_json import strict_dumps

__all__ = [
    "CHECKPOINT_FORMAT",
    "latest_checkpoint",
    "load_checkpoint",
    "load_checkpoint_side",
    "save_checkpoint",
]


def save_checkpoint(
    root: Path,
    round_index: int,
    tensors: dict[str, torch.Tensor],
    manifest: dict[str, Any],
    keep: int = 3,
    sides: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write round `round_index` so that a crash at any instant leaves either the old or the new checkpoint.

    `sides`: further tensor sets (e.g. the simulator's per-device stores) written as `NAME.safetensors`
    in the same atomic folder, each listed with its sha256 under the manifest's `sides`."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"round-{round_index:06d}"
    tmp = root / f".round-{round_index:06d}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    weights = tmp / "global.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights))
    side_sums: dict[str, str] = {}
    for name, side in (sides or {}).items():
        if not name.isidentifier():
            raise ConfigError(f"checkpoint side name {name!r} must be an identifier")
        save_file({k: v.contiguous() for k, v in side.items()}, str(tmp / f"{name}.safetensors"))
        side_sums[name] = sha256_file(tmp / f"{name}.safetensors")
    body = {
        **manifest,
        "format": CHECKPOINT_FORMAT,
        "round": round_index,
        "weights_sha256": sha256_file(weights),
        "sides": side_sums,
    }
    with (tmp / "manifest.json").open("w") as fh:
        fh.write(strict_dumps(body, indent=1, sort_keys=True))
        fh.flush()
        os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in sorted(root.glob("round-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_strategy_checkpoint(
    root: Path,
    round_index: int,
    strategy: Strategy,
    *,
    seed: int,
    totals: dict[str, Any] | None = None,
    sides: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """A strategy's round checkpoint: its state, the run's context, and its self-described deployables."""
    deployable_tensors, deployables = strategy.deployables()
    manifest = {
        "method": strategy.name,
        "strategy": strategy.state_meta(),
        "planning": strategy.planning_state(),  # the closed loop's speed factors and last choices
        "seed": seed,
        "totals": dict(totals or {}),
        "model": strategy.model.to_dict(),
        "context": strategy.ctx.to_record(),
        DEPLOYABLES: deployables,
    }
    return save_checkpoint(
        root,
        round_index,
        strategy.state_tensors(),
        manifest,
        sides={DEPLOYABLES: deployable_tensors, **(sides or {})},
    )
