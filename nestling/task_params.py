"""Typed hyper-parameter records of a task, one per local procedure.

A task's `hparams` travel as JSON; each procedure declares the record it accepts (`register(..., params=…)`), so
a board refuses a task whose hyper-parameters it does not know or whose values have the wrong type, naming the
key, before it trains anything. The board builds the record once, where the task arrives (edge/trainer.py), and
hands the procedure the record itself. The names and their defaults (what a board uses when a task leaves a key
out) are declared once, here, for the server that writes them and the board that reads them.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

from nestling.errors import ConfigError
from nestling.typed_values import accepts, as_declared

P = TypeVar("P", bound="TrainParams")


@dataclass(frozen=True)
class TrainParams:
    """What every procedure reads: the optimiser, batching, clipping, loss masking, precision and the task's
    place in the run. A default is what a board trains with when a task leaves its key out (the one place these
    defaults live; the run config's [train] section starts from them too)."""

    procedure: ClassVar[str] = "sgd"

    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    batch_size: int = 32
    local_epochs: int = 1
    local_steps: int | None = None
    grad_clip: float | None = None
    masked_ce: bool = False
    label_set: list[int] | None = None
    precision: str = "fp32"
    channels_last: bool = False
    seed: int = 0
    round: int = 0
    total_rounds: int = 1

    # Lower bounds of numeric fields (inclusive): a value below one is refused by name, as a wrong type is.
    minimums: ClassVar[dict[str, float]] = {
        "lr": 0.0,
        "momentum": 0.0,
        "weight_decay": 0.0,
        "batch_size": 1,
        "local_epochs": 0,
        "local_steps": 0,
        "grad_clip": 0.0,
        "round": 0,
        "total_rounds": 1,
    }

    def __post_init__(self) -> None:
        for key, low in self.minimums.items():
            value = getattr(self, key)
            if value is not None and value < low:
                raise ConfigError(f"task hyper-parameter '{key}' must be >= {low}, got {value!r}")

    @classmethod
    def from_hparams(cls: type[P], hp: dict[str, Any], procedure: str | None = None) -> P:
        """The record of `hp`; a ConfigError names an unknown key, a value of the wrong type or out of range."""
        name = procedure or cls.procedure
        declared = {f.name: f for f in fields(cls)}
        unknown = sorted(set(hp) - set(declared))
        if unknown:
            raise ConfigError(
                f"task hyper-parameters for procedure '{name}': unknown {unknown} (known: {', '.join(sorted(declared))})"
            )
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for key, value in hp.items():
            if not accepts(hints[key], value):
                raise ConfigError(
                    f"task hyper-parameter '{key}' for procedure '{name}' must be {hints[key]}, got {value!r}"
                )
            values[key] = as_declared(hints[key], value)
        try:
            return cls(**values)
        except ConfigError as exc:  # a value out of range: say which procedure's task carried it
            raise ConfigError(f"{exc} (procedure '{name}')") from None

    def to_hparams(self) -> dict[str, Any]:
        """The JSON form a task carries (every field, defaults included)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FjordParams(TrainParams):
    """FjORD's ordered dropout: the largest width p_max the board may sample, the width grid, self-distillation."""

    procedure: ClassVar[str] = "fjord"
    p_max: float = 1.0
    widths: list[float] | None = None
    fjord_kd: bool = False


@dataclass(frozen=True)
class DepthflParams(TrainParams):
    """DepthFL's mutual self-distillation (ramped over kd_ramp_rounds) and FedDyn's α."""

    procedure: ClassVar[str] = "depthfl-kd"
    kd: bool = True
    kd_ramp_rounds: int = 300
    feddyn_alpha: float = 0.0


@dataclass(frozen=True)
class ScaleflParams(TrainParams):
    """ScaleFL's self-distillation: weight γ, temperature, and when it starts (a share of the rounds)."""

    procedure: ClassVar[str] = "scalefl-sd"
    kd_gamma: float = 0.0
    kd_temperature: float = 3.0
    kd_start_fraction: float = 0.25


@dataclass(frozen=True)
class FedepthParams(TrainParams):
    """FeDepth's stage plan and its training rules; m-FeDepth's auxiliary models."""

    procedure: ClassVar[str] = "fedepth"
    plan: dict[str, Any] | None = None
    models: int = 1
    variant: str = "skip"
    stage_steps: str | int = "full"
    kd_weight: float = 1.0
    aggregate_bypassed: bool = True
    stem_every_stage: bool = False
    tier: int = 0
    initial_model: dict[str, Any] | None = None


@dataclass(frozen=True)
class DynamicflParams(TrainParams):
    """DynamicFL: how many convs the board may expand and the modulation rules (METHODS §5.a.5)."""

    procedure: ClassVar[str] = "dynamicfl"
    capacity: int = 0
    protocol: str = "paper"
    local_weight: float = 0.5
    cut_spread: float = 0.02
    cut_floor: float = 0.1
    keep_branches: bool = True
    recalibration_batches: int = 20
    inner_width: int | None = None
