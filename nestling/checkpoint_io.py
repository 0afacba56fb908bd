"""Reading round checkpoints, and the self-describing part every layer can read without the strategy.

A checkpoint folder `round-XXXXXX/` holds `global.safetensors` (the strategy's own state, only the strategy
that wrote it can interpret it), `manifest.json`, and side tensor sets. The side `deployables` makes the
checkpoint self-describing: the full model as deployed (`base/…`) plus every submodel the method defines
(`EvalTarget`s: name, spec with its full ModelConfig, evaluation flags) and how to assemble its weights:
the kernel's `extract(base, spec)` restricted to the target's keys, overlaid with the tensors that differ
from that slice (NeFL's per-submodel BN and steps; everything, for a target whose model is not the base
model). Export and boards read this; they never re-create the server's strategy.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from nestling.errors import ConfigError, SpecError
from nestling.eval_target import EvalTarget
from nestling.hashing import sha256_file
from nestling.models.config import ModelConfig
from nestling.slicing import check_compatible, extract
from nestling.spec import SubmodelSpec

CHECKPOINT_FORMAT = 1
DEPLOYABLES = "deployables"  # side name and manifest key
DEPLOYABLES_FORMAT = 1
log = logging.getLogger("nestling.checkpoint")

UPGRADE_HINT = "re-save it with `nestling upgrade-checkpoint RUN_DIR` (written by Nestling before checkpoints described their submodels)"


def checkpoint_damage(candidate: Path) -> str | None:
    """Why a checkpoint folder cannot be used (missing file, unreadable manifest, sha256 mismatch), or None."""
    manifest = candidate / "manifest.json"
    weights = candidate / "global.safetensors"
    for required in (manifest, weights):
        if not required.is_file():
            return f"{required.name} is missing"
    try:
        body = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return "manifest.json is unreadable"
    if not isinstance(body, dict):
        return "manifest.json is not a JSON object"
    if body.get("weights_sha256") != sha256_file(weights):
        return "global.safetensors does not match its sha256 (truncated or altered)"
    sides = body.get("sides", {}) if isinstance(body.get("sides", {}), dict) else {}
    for name, digest in sides.items():
        side = candidate / f"{name}.safetensors"
        if not side.is_file() or sha256_file(side) != digest:
            return f"{name}.safetensors is missing or does not match its sha256"
    return None


def latest_checkpoint(root: Path, *, warn: bool = True) -> Path | None:
    """Newest checkpoint whose manifest and weights are complete and match their sha256. A damaged newer one
    is reported by name (a WARNING) before the fall back to an older one, never skipped in silence."""
    for candidate in sorted(root.glob("round-*"), reverse=True):
        damage = checkpoint_damage(candidate)
        if damage is None:
            return candidate
        if warn:
            log.warning("checkpoint %s is damaged (%s): falling back to an older one", candidate, damage)
    return None


def resolve_checkpoint(path: Path) -> Path:
    """A `round-XXXXXX` folder as given, or the newest complete one under a run or checkpoints folder."""
    if (path / "manifest.json").is_file():
        return path
    for root in (path, path / "checkpoints"):
        if root.is_dir():
            found = latest_checkpoint(root)
            if found is not None:
                return found
    raise ConfigError(
        f"no complete checkpoint at {path} (expected round-XXXXXX/ with manifest.json, or a folder holding them)"
    )


def read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise ConfigError(f"checkpoint {path} has no manifest.json")
    manifest: dict[str, Any] = json.loads(manifest_path.read_text())
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(
            f"checkpoint {path} has format {manifest.get('format')}, expected {CHECKPOINT_FORMAT}"
        )
    return manifest


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The strategy state and the manifest of one checkpoint folder."""
    manifest = read_manifest(path)
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


# -- deployables ---------------------------------------------------------------------------------------------


@dataclass
class Deployables:
    """What a checkpoint can deploy: the full model as deployed and every submodel the method defines."""

    model: ModelConfig
    base: dict[str, torch.Tensor]
    targets: list[EvalTarget]


def _sliced(base: dict[str, torch.Tensor], model: ModelConfig, spec: SubmodelSpec) -> dict[str, torch.Tensor]:
    if spec.model != model:
        return {}
    try:
        check_compatible(base, spec)
    except SpecError:
        return {}
    return extract(base, spec)


def pack_deployables(
    model: ModelConfig, base: dict[str, torch.Tensor], targets: list[EvalTarget]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and the JSON record that describe `targets` compactly (see the module docstring)."""
    tensors = {f"base/{key}": value.detach().contiguous() for key, value in base.items()}
    described = []
    for index, target in enumerate(targets):
        sliced = _sliced(base, model, target.spec)
        overlay = [
            key
            for key, value in target.state.items()
            if key not in sliced or sliced[key].shape != value.shape or not torch.equal(sliced[key], value)
        ]
        for key in overlay:
            tensors[f"target{index}/{key}"] = target.state[key].detach().contiguous()
        described.append(
            {
                "name": target.name,
                "spec": target.spec.to_dict(),
                "ensemble": target.ensemble,
                "static_bn": target.static_bn,
                "active_width": target.active_width,
                "keys": sorted(target.state),
                "overlay": sorted(overlay),
            }
        )
    return tensors, {"format": DEPLOYABLES_FORMAT, "model": model.to_dict(), "targets": described}


def unpack_deployables(tensors: dict[str, torch.Tensor], record: dict[str, Any]) -> Deployables:
    """The inverse of `pack_deployables`: every target with exactly the weights it was saved with."""
    if record.get("format") != DEPLOYABLES_FORMAT:
        raise ConfigError(f"deployables format {record.get('format')!r} is not {DEPLOYABLES_FORMAT}")
    model = ModelConfig.from_dict(record["model"])
    base = {key[5:]: value for key, value in tensors.items() if key.startswith("base/")}
    targets = []
    for index, entry in enumerate(record["targets"]):
        spec = SubmodelSpec.from_dict(entry["spec"])
        sliced = _sliced(base, model, spec)
        overlay = set(entry["overlay"])
        state = {}
        for key in entry["keys"]:
            source = tensors.get(f"target{index}/{key}") if key in overlay else sliced.get(key)
            if source is None:
                raise ConfigError(
                    f"deployable {entry['name']!r} lacks tensor {key!r}: the checkpoint is damaged"
                )
            state[key] = source
        targets.append(
            EvalTarget(
                name=str(entry["name"]),
                spec=spec,
                state=state,
                ensemble=bool(entry["ensemble"]),
                static_bn=bool(entry["static_bn"]),
                active_width=None if entry["active_width"] is None else float(entry["active_width"]),
            )
        )
    return Deployables(model, base, targets)


def load_deployables(path: Path) -> tuple[Deployables, dict[str, Any]]:
    """A checkpoint's deployables and manifest; a checkpoint written without them gets a clear error."""
    manifest = read_manifest(path)
    record = manifest.get(DEPLOYABLES)
    tensors = load_checkpoint_side(path, DEPLOYABLES)
    if record is None or tensors is None:
        raise ConfigError(f"checkpoint {path} does not describe its submodels: {UPGRADE_HINT}")
    return unpack_deployables(tensors, record), manifest
