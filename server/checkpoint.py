"""Atomic round checkpoints: `round-000123/` with `global.safetensors` + `manifest.json` (temp dir + rename)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from nestling.errors import ConfigError
from nestling.hashing import sha256_file

CHECKPOINT_FORMAT = 1


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
        json.dump(body, fh, indent=1, sort_keys=True)
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


def latest_checkpoint(root: Path) -> Path | None:
    """Newest checkpoint whose manifest and weights are complete and match their sha256."""
    for candidate in sorted(root.glob("round-*"), reverse=True):
        manifest = candidate / "manifest.json"
        weights = candidate / "global.safetensors"
        if not (manifest.is_file() and weights.is_file()):
            continue
        try:
            body = json.loads(manifest.read_text())
        except json.JSONDecodeError:
            continue
        sides = body.get("sides", {}) if isinstance(body.get("sides", {}), dict) else {}
        if body.get("weights_sha256") == sha256_file(weights) and all(
            (candidate / f"{name}.safetensors").is_file()
            and sha256_file(candidate / f"{name}.safetensors") == digest
            for name, digest in sides.items()
        ):
            return candidate
    return None


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise ConfigError(f"checkpoint {path} has no manifest.json")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(
            f"checkpoint {path} has format {manifest.get('format')}, expected {CHECKPOINT_FORMAT}"
        )
    return load_file(str(path / "global.safetensors")), manifest


def load_checkpoint_side(path: Path, name: str) -> dict[str, torch.Tensor] | None:
    """Side tensor set `name` of a checkpoint, or None when the checkpoint was written without it."""
    manifest = json.loads((path / "manifest.json").read_text())
    digest = manifest.get("sides", {}).get(name)
    if digest is None:
        return None
    file = path / f"{name}.safetensors"
    if not file.is_file() or sha256_file(file) != digest:
        raise ConfigError(f"checkpoint {path}: {name}.safetensors is missing or does not match its sha256")
    return load_file(str(file))
