"""Where exported weights come from: a checkpoint's self-described deployables (nestling.checkpoint_io).

Export reads what the strategy wrote beside its state when it saved the round: each submodel's spec (with its
full ModelConfig) and weights. It never re-creates the server's strategy, so a board can export too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nestling.methods  # noqa: F401  (the methods' exit heads register before a model is built)
from nestling.checkpoint_io import Deployables, load_deployables, resolve_checkpoint
from nestling.errors import ConfigError, SpecError
from nestling.eval_target import EvalTarget
from nestling.models.config import ModelConfig
from nestling.slicing import check_compatible, extract
from nestling.spec import SubmodelSpec


@dataclass
class CheckpointSource:
    """A checkpoint's deployables plus the manifest facts export records."""

    path: Path
    manifest: dict[str, Any]
    deployables: Deployables

    @property
    def method(self) -> str:
        return str(self.manifest["method"])

    @property
    def round(self) -> int:
        return int(self.manifest.get("round", -1))

    @property
    def dataset(self) -> str | None:
        return self.manifest.get("context", {}).get("dataset")

    @property
    def model(self) -> ModelConfig:
        """The method's full model (a spec given with --spec must be a submodel of it)."""
        return self.deployables.model

    def targets(self) -> list[EvalTarget]:
        """Every submodel the method defines, smallest first (NeFL: k1..k5 with their own BN and steps)."""
        return list(self.deployables.targets)


def open_checkpoint(path: Path) -> CheckpointSource:
    """Open a `round-XXXXXX` folder, or the newest complete one under a run or checkpoints folder."""
    folder = resolve_checkpoint(Path(path))
    deployables, manifest = load_deployables(folder)
    return CheckpointSource(folder, manifest, deployables)


def select_target(
    source: CheckpointSource,
    *,
    submodel: str | None = None,
    level: int | None = None,
    spec: SubmodelSpec | None = None,
) -> EvalTarget:
    """One submodel by name or spec id (`--submodel`), 1-based position (`--level`), or an explicit spec."""
    chosen = [
        name
        for name, value in (("--submodel", submodel), ("--level", level), ("--spec", spec))
        if value is not None
    ]
    if len(chosen) != 1:
        raise ConfigError(
            f"choose exactly one of --submodel, --level, --spec (got {', '.join(chosen) or 'none'})"
        )
    targets = source.targets()
    listing = ", ".join(f"{t.name} ({t.spec.id})" for t in targets)
    if submodel is not None:
        for target in targets:
            if submodel in (target.name, target.spec.id):
                return target
        raise ConfigError(f"{source.method} checkpoint has no submodel '{submodel}' (known: {listing})")
    if level is not None:
        if not 1 <= level <= len(targets):
            raise ConfigError(f"--level must be 1..{len(targets)} for {source.method} (levels: {listing})")
        return targets[level - 1]
    assert spec is not None
    return spec_target(source, spec)


def spec_target(source: CheckpointSource, spec: SubmodelSpec) -> EvalTarget:
    """Weights for any spec, sliced from the deployable full model (NeFL: the largest submodel's BN)."""
    model = source.model
    if spec.model != model:
        raise SpecError(
            f"the spec's model {spec.model.to_dict()} is not the checkpoint's model {model.to_dict()}"
        )
    state = source.deployables.base
    check_compatible(state, spec)
    per_width = spec.width if model.norm_stats == "per_width" else None
    return EvalTarget(f"spec-{spec.id}", spec, extract(state, spec), active_width=per_width)


def load_spec_file(path: Path) -> SubmodelSpec:
    try:
        return SubmodelSpec.from_dict(json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read submodel spec {path}: {exc}") from None
