"""A board's measured profile, as it travels in the hello: what training may use, how fast each block runs.

The agent measures the fleet's full model on its own device (edge/self_profile.py) or, when it emulates a
catalogue class, derives the class's figures from the cost model the emulation pads to; the server checks the
summary field by field (`parse_board_profile`) and plans from it (profiler/fit.py). Predicted local training
time of a submodel = the measured per-part forward + backward latencies of the full model, each scaled by the
submodel's share of that part's MACs, times the whole-step / sum-of-parts ratio, per sample trained. A measured
board also times the whole step of a narrower member (`NARROW_WIDTH`): what of a step does not shrink with the
submodel (per-op dispatch, loss, optimizer bookkeeping, narrow layers running below their MAC rate) becomes a
fixed cost per step, so the step is affine in that MAC-scaled time instead of proportional to it. A task is
counted in whole steps (its last, partial batch pays the whole fixed cost, only its own samples' share of the
rest), plus what a measured board timed a task to cost besides its steps (`task_s`: building the slice, loading
its weights, the first step's warm-up, copying the trained weights out).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any

from nestling.models.config import ModelConfig
from nestling.profiler.estimator import estimate
from nestling.profiler.speed import FLOPS_PER_MAC, TRAIN_OVER_FORWARD
from nestling.spec import SubmodelSpec

SCHEMA = "nestling.board_profile/1"
# Bounds of every field: generous for any real board, small enough that a hello stays far under the 64 KiB
# control frame and nothing downstream (planning arithmetic, metrics) meets an absurd number.
MAX_PARTS = 256
MAX_BYTES = 2**50
MAX_GFLOPS = 1e5  # 100 TFLOP/s of sustained fp32 training: above any single accelerator a board carries
MAX_STEP_S = 3600.0
MIN_STEP_S = 1e-5  # no training step runs faster than PyTorch dispatches it: a plan never predicts 0 s
# The whole step over the sum of its separately timed parts: ~1-2 when measured, 1 when emulated. Outside these
# bounds the parts do not describe the step (all-zero part times would predict every submodel free).
MIN_OVERHEAD, MAX_OVERHEAD = 0.05, 20.0
MAX_BATCH = 65536
# The narrower member a measured board times besides the full model: every block kept, this channel ratio. A
# quarter of the width (1/16 of the MACs) puts the planned members between the two points (planning.py's
# narrowest NeFL-WD member is 30 % of the MACs) and keeps the fixed cost well clear of the timing noise.
NARROW_WIDTH = 0.25
MIN_NARROW_WIDTH = 0.01
MAX_NARROW_WIDTH = 0.75
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
    "narrow",
    "task_s",
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
class NarrowFigure:
    """The whole training step of the full model's narrower member (`narrow_spec(width)`) at the profile's batch."""

    width: float
    step_s: float


def narrow_spec(full_spec: SubmodelSpec, width: float) -> SubmodelSpec:
    """The narrower member a board times: the full model's every block, exit and head at `width`."""
    return SubmodelSpec(full_spec.model, width=width, exits=full_spec.model.exit_points)


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
    # A measured board's second point; None for emulated boards (their emulation is exactly MAC-proportional)
    # and for profiles made before it existed, which predict as they always did.
    narrow: NarrowFigure | None = None
    # A measured board's seconds per task besides its steps (edge/self_profile.measure_task_s); None for emulated
    # boards (their emulation pads the whole task to FLOPs) and older profiles.
    task_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        # by hand, not dataclasses.asdict: a hello's 256 parts are written on every registration
        data: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        data["schema"] = SCHEMA
        data["parts"] = [
            {
                "name": p.name,
                "forward_s": p.forward_s,
                "backward_s": p.backward_s,
                "activation_bytes": p.activation_bytes,
            }
            for p in self.parts
        ]
        if self.narrow is not None:
            data["narrow"] = {"width": self.narrow.width, "step_s": self.narrow.step_s}
        for optional in ("narrow", "task_s"):  # absent, not null: a profile without them reads as before
            if data[optional] is None:
                del data[optional]
        return data

    @property
    def overhead(self) -> float:
        """Whole training step over the sum of its parts (loss, optimizer step, what parts alone miss)."""
        parts = sum(p.forward_s + p.backward_s for p in self.parts)
        return self.step_s / parts if parts > 0 else 1.0

    def scaled_step_seconds(self, spec: SubmodelSpec) -> float:
        """One step of `spec` as the full model's measured parts scaled by MACs (the prediction without a
        fixed cost: exact for an emulated board, which pads to FLOPs)."""
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

    def fixed_step_s(self, model: ModelConfig) -> float:
        """Seconds of a step of `model`'s members that do not shrink with the submodel, from the narrow point:
        narrow = fixed + (full − fixed) × s, s the narrow member's MAC-scaled share of the full step. Kept in
        [0, min(narrow, full)]: a narrow member measured faster than MAC scaling says gives 0 (the plain
        rule), so the field can neither lower a prediction below MAC scaling nor raise one above the full
        model's step."""
        if self.narrow is None:
            return 0.0
        full_spec = SubmodelSpec.full(model)
        full = self.scaled_step_seconds(full_spec)
        share = (
            self.scaled_step_seconds(narrow_spec(full_spec, self.narrow.width)) / full if full > 0 else 1.0
        )
        if not 0.0 <= share < 1.0:
            return 0.0
        fixed = (self.narrow.step_s - full * share) / (1.0 - share)
        return min(max(fixed, 0.0), self.narrow.step_s, full)

    def step_parts(self, spec: SubmodelSpec) -> tuple[float, float]:
        """One full-batch training step of `spec`: (the fixed cost the narrow point measured, the rest), the rest
        being (full − fixed) × scaled / full of the MAC-scaled step."""
        scaled = self.scaled_step_seconds(spec)
        fixed = self.fixed_step_s(spec.model)
        if fixed <= 0.0:
            return 0.0, scaled
        full = self.scaled_step_seconds(SubmodelSpec.full(spec.model))
        return fixed, (1.0 - fixed / full) * scaled

    def step_seconds(self, spec: SubmodelSpec) -> float:
        """Predicted seconds of one training step of `spec` at this profile's batch size: the MAC-scaled step,
        made affine by the fixed cost the narrow point measured (fixed + (full − fixed) × scaled / full)."""
        return sum(self.step_parts(spec))

    def train_seconds(self, spec: SubmodelSpec, samples: int, steps: int | None = None) -> float:
        """Predicted local training time of `samples` samples (profiler.speed.samples_trained) of `spec` in
        `steps` steps (profiler.speed.steps_trained; by default ⌈samples / batch⌉): task_s + steps × the fixed
        cost per step + samples × the rest of a step per sample, so a partial batch pays the whole fixed cost and
        its own samples' share of the rest. An emulated board (no fixed costs) predicts exactly the FLOPs its
        emulation pads to."""
        if samples <= 0:
            return float(self.task_s or 0.0)
        fixed, rest = self.step_parts(spec)
        count = -(-int(samples) // self.batch) if steps is None else int(steps)
        predicted = float(self.task_s or 0.0) + count * fixed + rest * samples / self.batch
        return max(predicted, max(count, 1) * MIN_STEP_S)


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
    measured: dict[str, Any],
    gflops: float,
    available_bytes: int,
    margin: float,
    narrow: NarrowFigure | None = None,
    task_s: float | None = None,
) -> BoardProfile:
    """The summary of `profiler.measure.profile_model` output on this board (medians, seconds), with the
    narrower member's step and the cost per task besides its steps when the board timed them."""
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
        narrow,
        task_s,
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


def _narrow(data: dict[str, Any]) -> NarrowFigure | None:
    """The optional narrow point: absent in emulated and older profiles; bounded like every other figure."""
    if "narrow" not in data:
        return None
    raw = data["narrow"]
    if not isinstance(raw, dict) or set(raw) != {"width", "step_s"}:
        raise ProfileError("narrow", "must hold width and step_s")
    try:
        width = float(_number(raw, "width", MIN_NARROW_WIDTH, MAX_NARROW_WIDTH))
        step = float(_number(raw, "step_s", MIN_STEP_S, MAX_STEP_S))
    except ProfileError as exc:
        raise ProfileError(f"narrow.{exc.field}", str(exc).split(": ", 1)[1]) from None
    return NarrowFigure(width, step)


def _task_s(data: dict[str, Any]) -> float | None:
    """The optional seconds per task besides its steps: absent in emulated and older profiles."""
    if "task_s" not in data:
        return None
    return float(_number(data, "task_s", 0.0, MAX_STEP_S))


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
    step_s = float(_number(data, "step_s", MIN_STEP_S, MAX_STEP_S))
    timed = sum(p.forward_s + p.backward_s for p in parts)
    if not timed * MIN_OVERHEAD <= step_s <= timed * MAX_OVERHEAD:
        raise ProfileError(
            "parts",
            f"part times summing to {timed:.3g} s do not describe a step of {step_s:.3g} s "
            f"(allowed: {MIN_OVERHEAD}-{MAX_OVERHEAD} times their sum)",
        )
    source = _text(data, "source")
    if source != "measured" and not source.startswith("emulated:"):
        raise ProfileError("source", f"must be 'measured' or 'emulated:<class>', got {source!r:.40}")
    narrow = _narrow(data)
    if narrow is not None and source != "measured":
        raise ProfileError(
            "narrow", "only a measured profile has a narrow point (an emulation scales by MACs)"
        )
    task_s = _task_s(data)
    if task_s is not None and source != "measured":
        raise ProfileError(
            "task_s", "only a measured profile has a cost per task (an emulation pads to FLOPs)"
        )
    return BoardProfile(
        spec_id=_text(data, "spec_id"),
        arch=_text(data, "arch"),
        batch=int(_number(data, "batch", 1, MAX_BATCH, integer=True)),
        memory_bytes=int(_number(data, "memory_bytes", 1, MAX_BYTES, integer=True)),
        margin=float(_number(data, "margin", 0.0, 0.95)),
        gflops=float(_number(data, "gflops", 1e-6, MAX_GFLOPS)),
        step_s=step_s,
        parts=tuple(parts),
        source=source,
        narrow=narrow,
        task_s=task_s,
    )


__all__ = [
    "NARROW_WIDTH",
    "SCHEMA",
    "BoardProfile",
    "NarrowFigure",
    "PartFigure",
    "ProfileError",
    "emulated_board_profile",
    "measured_board_profile",
    "narrow_spec",
    "parse_board_profile",
]
