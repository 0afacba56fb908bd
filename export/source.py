"""Where exported weights come from: a checkpoint, re-opened through the strategy that wrote it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nestling.errors import ConfigError, SpecError
from nestling.eval_target import EvalTarget
from nestling.server.checkpoint import latest_checkpoint, load_checkpoint
from nestling.server.strategies import Strategy, StrategyContext, create_strategy
from nestling.slicing import check_compatible, extract
from nestling.spec import SubmodelSpec


@dataclass
class CheckpointSource:
    """A re-created strategy holding a checkpoint's state, plus the manifest facts export records."""

    path: Path
    manifest: dict[str, Any]
    strategy: Strategy

    @property
    def method(self) -> str:
        return str(self.manifest["method"])

    @property
    def round(self) -> int:
        return int(self.manifest.get("round", -1))

    @property
    def dataset(self) -> str | None:
        return self.manifest.get("context", {}).get("dataset")

    def targets(self) -> list[EvalTarget]:
        """Every submodel the method defines, smallest first (NeFL: k1..k5 with their own BN and steps)."""
        return self.strategy.eval_targets()


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
        f"no complete checkpoint at {path} (expected round-XXXXXX/ with manifest.json, "
        "or a folder holding them)"
    )


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


def open_checkpoint(path: Path) -> CheckpointSource:
    """Load a checkpoint and re-create its strategy with the checkpoint's state."""
    folder = resolve_checkpoint(Path(path))
    tensors, manifest = load_checkpoint(folder)
    strategy = create_strategy(str(manifest.get("method")), context_from_manifest(manifest))
    if "model" in manifest and strategy.model.to_dict() != manifest["model"]:
        raise ConfigError(
            f"checkpoint {folder} was written for a different model than its method re-creates; "
            "its manifest lacks the run's method options"
        )
    strategy.load_state(tensors, manifest.get("strategy", {}))
    return CheckpointSource(folder, manifest, strategy)


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
    model = source.strategy.model
    if spec.model != model:
        raise SpecError(
            f"the spec's model {spec.model.to_dict()} is not the checkpoint's model {model.to_dict()}"
        )
    state = source.strategy.global_export_state()
    check_compatible(state, spec)
    per_width = spec.width if model.norm_stats == "per_width" else None
    return EvalTarget(f"spec-{spec.id}", spec, extract(state, spec), active_width=per_width)


def load_spec_file(path: Path) -> SubmodelSpec:
    try:
        return SubmodelSpec.from_dict(json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read submodel spec {path}: {exc}") from None
