"""A board's measured profile, as it travels in the hello: what training may use, how fast each block runs.

The agent measures the fleet's full model on its own device (edge/self_profile.py) or, when it emulates a
catalogue class, derives the class's figures from the cost model the emulation pads to; the server checks the
summary field by field (`parse_board_profile`) and plans from it (profiler/fit.py). Predicted local training
time of a submodel = the measured per-part forward + backward latencies of the full model, each scaled by the
submodel's share of that part's MACs, times the whole-step / sum-of-parts ratio, per sample trained.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from nestling.profiler.estimator import estimate
from nestling.profiler.speed import FLOPS_PER_MAC, TRAIN_OVER_FORWARD
from nestling.spec import SubmodelSpec

SCHEMA = "nestling.board_profile/1"
# Bounds of every field: generous for any real board, small enough that a hello stays far under the 64 KiB
# control frame and nothing downstream (planning arithmetic, metrics) meets an absurd number.
MAX_PARTS = 256
MAX_BYTES = 2**50
MAX_GFLOPS = 1e6
MAX_STEP_S = 3600.0
MAX_BATCH = 65536
_NAME = re.compile(r"^[a-z]{1,8}[0-9]{0,5}$")  # stem, block12, exit5, head
_FIELDS = {
    "schema",
    "spec_id",
    "arch",
    "batch",
    "memory_bytes",
    "margin",
    "gflops",
    "step_s",
    "parts",
    "source",
}


class ProfileError(ValueError):
    """A profile summary that cannot be trusted; `field` names what was wrong (the server's rejection)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"board_profile.{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class PartFigure:
    """One part of the full model at the profile's batch: forward and backward seconds, saved activations."""

    name: str
    forward_s: float
    backward_s: float
    activation_bytes: int


@dataclass(frozen=True)
class BoardProfile:
    """The summary a board sends: memory training may use (after its safety margin), sustained GFLOP/s,
    the full model's step and per-part figures at the task batch size, and where they come from."""

    spec_id: str  # the full model measured (SubmodelSpec.id): a profile of another model is not used
    arch: str
    batch: int
    memory_bytes: int
    margin: float
    gflops: float
    step_s: float
    parts: tuple[PartFigure, ...]
    source: str  # "measured" or "emulated:<class>"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["schema"] = SCHEMA
        data["parts"] = [asdict(p) for p in self.parts]
        return data

    @property
    def overhead(self) -> float:
        """Whole training step over the sum of its parts (loss, optimizer step, what parts alone miss)."""
        parts = sum(p.forward_s + p.backward_s for p in self.parts)
        return self.step_s / parts if parts > 0 else 1.0

    def step_seconds(self, spec: SubmodelSpec) -> float:
        """Predicted seconds of one training step of `spec` at this profile's batch size."""
        full = {p.name: p.forward_macs for p in estimate(SubmodelSpec.full(spec.model), self.batch).parts}
        figures = {p.name: p for p in self.parts}
        seconds = 0.0
        for part in estimate(spec, self.batch).parts:
            figure, full_macs = figures.get(part.name), full.get(part.name)
            if figure is not None and full_macs:
                seconds += (figure.forward_s + figure.backward_s) * part.forward_macs / full_macs
            else:  # a part the board did not measure: its FLOPs at the board's sustained speed
                flops = part.forward_macs * FLOPS_PER_MAC * TRAIN_OVER_FORWARD * self.batch
                seconds += flops / (self.gflops * 1e9)
        return seconds * self.overhead

    def train_seconds(self, spec: SubmodelSpec, samples: int) -> float:
        """Predicted local training time of `samples` samples (profiler.speed.samples_trained) of `spec`."""
        return self.step_seconds(spec) * samples / self.batch


def emulated_board_profile(
    full_spec: SubmodelSpec, batch: int, gflops: float, memory_bytes: int, board: str, margin: float = 0.0
) -> BoardProfile:
    """The figures of a catalogue class an agent emulates: every part's training FLOPs at the class's
    sustained speed (exactly what edge/emulation.py pads to), activations from the estimator."""
    cost = estimate(full_spec, batch)
    parts = tuple(
        PartFigure(
            p.name,
            FLOPS_PER_MAC * p.forward_macs * batch / (gflops * 1e9),
            FLOPS_PER_MAC * (TRAIN_OVER_FORWARD - 1) * p.forward_macs * batch / (gflops * 1e9),
            int(p.activation_bytes),
        )
        for p in cost.parts
    )
    step = sum(p.forward_s + p.backward_s for p in parts)
    return BoardProfile(
        full_spec.id,
        full_spec.model.arch,
        batch,
        int(memory_bytes * (1.0 - margin)),
        margin,
        float(gflops),
        step,
        parts,
        f"emulated:{board}",
    )


def measured_board_profile(
    measured: dict[str, Any], gflops: float, available_bytes: int, margin: float
) -> BoardProfile:
    """The summary of `profiler.measure.profile_model` output on this board (medians, seconds)."""
    parts = tuple(
        PartFigure(
            str(p["name"]),
            float(p["forward_ms"]["median"]) / 1000.0,
            float(p["backward_ms"]["median"]) / 1000.0,
            int(p["memory"]["activations_bytes"]),
        )
        for p in measured["parts"]
    )
    model = measured["model"]
    return BoardProfile(
        str(model["spec_id"]),
        str(model["arch"]),
        int(model["batch"]),
        int(available_bytes * (1.0 - margin)),
        margin,
        float(gflops),
        float(measured["total"]["step_ms"]["median"]) / 1000.0,
        parts,
        "measured",
    )


def _number(data: dict[str, Any], name: str, low: float, high: float, *, integer: bool = False) -> Any:
    value: Any = data.get(name)
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ProfileError(name, f"must be {'an integer' if integer else 'a number'}, got {value!r:.40}")
    # integers compare exactly (float(10**400) would overflow); floats must be finite
    number: float | int = value if isinstance(value, int) else float(value if isinstance(value, float) else 0)
    if (isinstance(number, float) and not math.isfinite(number)) or not low <= number <= high:
        raise ProfileError(name, f"must lie in [{low:g}, {high:g}], got {value!r:.40}")
    return value


def _text(data: dict[str, Any], name: str, limit: int = 64) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise ProfileError(name, f"must be a string of 1-{limit} characters")
    return value


def parse_board_profile(data: Any) -> BoardProfile:
    """A profile summary from the network, checked field by field (ProfileError names the field)."""
    if not isinstance(data, dict):
        raise ProfileError("schema", f"must be an object, got {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise ProfileError("schema", f"must be {SCHEMA!r}, got {data.get('schema')!r:.40}")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise ProfileError(str(unknown[0])[:32], "is not a profile field")
    raw_parts = data.get("parts")
    if not isinstance(raw_parts, list) or not 0 < len(raw_parts) <= MAX_PARTS:
        raise ProfileError("parts", f"must be a list of 1-{MAX_PARTS} parts")
    parts = []
    for i, raw in enumerate(raw_parts):
        if not isinstance(raw, dict) or set(raw) != {"name", "forward_s", "backward_s", "activation_bytes"}:
            raise ProfileError(f"parts[{i}]", "must hold name, forward_s, backward_s, activation_bytes")
        name = raw["name"]
        if not isinstance(name, str) or not _NAME.match(name):
            raise ProfileError(f"parts[{i}].name", f"is not a part name: {name!r:.40}")
        parts.append(
            PartFigure(
                name,
                float(_number(raw, "forward_s", 0.0, MAX_STEP_S)),
                float(_number(raw, "backward_s", 0.0, MAX_STEP_S)),
                int(_number(raw, "activation_bytes", 0, MAX_BYTES, integer=True)),
            )
        )
    if len({p.name for p in parts}) != len(parts):
        raise ProfileError("parts", "names a part twice")
    source = _text(data, "source")
    if source != "measured" and not source.startswith("emulated:"):
        raise ProfileError("source", f"must be 'measured' or 'emulated:<class>', got {source!r:.40}")
    return BoardProfile(
        spec_id=_text(data, "spec_id"),
        arch=_text(data, "arch"),
        batch=int(_number(data, "batch", 1, MAX_BATCH, integer=True)),
        memory_bytes=int(_number(data, "memory_bytes", 1, MAX_BYTES, integer=True)),
        margin=float(_number(data, "margin", 0.0, 0.95)),
        gflops=float(_number(data, "gflops", 1e-6, MAX_GFLOPS)),
        step_s=float(_number(data, "step_s", 1e-9, MAX_STEP_S)),
        parts=tuple(parts),
        source=source,
    )


__all__ = [
    "SCHEMA",
    "BoardProfile",
    "PartFigure",
    "ProfileError",
    "emulated_board_profile",
    "measured_board_profile",
    "parse_board_profile",
]
