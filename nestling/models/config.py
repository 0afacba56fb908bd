"""ModelConfig: the architecture family and its method-specific switches, shared by server and board."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from nestling.errors import ConfigError

NORM_STATS = ("running", "batch", "per_width")
SCALER_MODES = ("none", "train", "always")


@dataclass(frozen=True)
class ModelConfig:
    """Which global model a fleet trains; every SubmodelSpec is a slice of this model.

    `exit_points` are the block indices after which the *global* model carries an exit head;
    a submodel keeps a subset of them (SubmodelSpec.exits).
    """

    arch: str
    num_classes: int = 10
    in_channels: int = 3
    image_size: int = 32
    norm_stats: str = "running"
    scaler: str = "none"
    exit_points: tuple[int, ...] = ()
    exit_kind: str = "linear"
    learnable_step: bool = True
    width_levels: tuple[float, ...] = ()  # per-width BN levels (FjORD)
    rounding: str = "ceil"
    extra: dict[str, Any] = field(default_factory=dict)  # architecture-specific (ViT dims, ...)

    def __post_init__(self) -> None:
        if self.norm_stats not in NORM_STATS:
            raise ConfigError(
                f"[model] unknown norm_stats '{self.norm_stats}' (known: {', '.join(NORM_STATS)})"
            )
        if self.scaler not in SCALER_MODES:
            raise ConfigError(f"[model] unknown scaler '{self.scaler}' (known: {', '.join(SCALER_MODES)})")
        if not isinstance(self.exit_kind, str) or not self.exit_kind:
            # which kinds exist is the exit-head registry's answer (nestling.models.heads), asked at build time
            raise ConfigError(f"[model] exit_kind must be the name of an exit head, got {self.exit_kind!r}")
        if self.rounding not in ("ceil", "floor"):
            raise ConfigError(f"[model] rounding must be 'ceil' or 'floor', got '{self.rounding}'")
        if self.num_classes < 1 or self.in_channels < 1 or self.image_size < 4:
            raise ConfigError("[model] num_classes, in_channels must be >= 1 and image_size >= 4")
        if self.norm_stats == "per_width" and not self.width_levels:
            raise ConfigError("[model] norm_stats 'per_width' needs width_levels")
        if "layout" in self.extra:
            object.__setattr__(
                self, "extra", {**self.extra, "layout": validated_layout(self.extra["layout"])}
            )
        object.__setattr__(self, "exit_points", tuple(sorted(int(e) for e in self.exit_points)))
        object.__setattr__(self, "width_levels", tuple(float(w) for w in self.width_levels))

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["exit_points"] = list(self.exit_points)
        data["width_levels"] = list(self.width_levels)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"[model] unknown keys {sorted(unknown)} (known: {sorted(known)})")
        values = dict(data)
        values["exit_points"] = tuple(values.get("exit_points", ()))
        values["width_levels"] = tuple(values.get("width_levels", ()))
        values["extra"] = dict(values.get("extra", {}))
        return cls(**values)

    def with_(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)


def validated_layout(layout: Any) -> dict[str, list[int]]:
    """`extra["layout"]` of a grown ResNet-family model, checked and normalised to plain lists of ints.

    {"stage_blocks": blocks per stage, "block_hidden": every block's internal width in channels, in depth
    order}. Absolute channel counts rather than ratios: a grown width (Net2WiderNet doubles 16 to 32) is
    exact, JSON keeps it, and no rounding rule can move it. The family checks the stage count.
    """
    if not isinstance(layout, dict) or set(layout) != {"stage_blocks", "block_hidden"}:
        raise ConfigError(
            f"[model] extra.layout must be a table with exactly stage_blocks and block_hidden, got {layout!r}"
        )
    checked: dict[str, list[int]] = {}
    for key in ("stage_blocks", "block_hidden"):
        values = layout[key]
        if (
            not isinstance(values, (list, tuple))
            or not values
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values)
        ):
            raise ConfigError(
                f"[model] extra.layout.{key} must be a non-empty list of integers >= 1, got {values!r}"
            )
        checked[key] = [int(v) for v in values]
    if len(checked["block_hidden"]) != sum(checked["stage_blocks"]):
        raise ConfigError(
            f"[model] extra.layout.block_hidden has {len(checked['block_hidden'])} entries, "
            f"stage_blocks {checked['stage_blocks']} make {sum(checked['stage_blocks'])} blocks"
        )
    return checked
