"""The board measures itself for the fleet's model, once, and keeps the result in its state folder.

The server announces its full model and batch size in its retained status (`ServerStatus.plan`). The agent
measures that model on its own device (available training memory with a safety margin, sustained GFLOP/s,
per-part forward/backward latency and activations: profiler/measure.py) or, when it emulates a catalogue
class, takes the class's figures (profiler/board_profile.py). A measuring board also times the whole step of the
model's narrower member in turn with the full one, the second point that makes its predicted step affine in the
MAC-scaled time, and times whole one-step tasks (`edge/trainer.run_task`, as a real task runs) for what a task
costs besides its steps. The summary is cached under a key of everything it depends on (model, batch, torch version,
board, margin, emulated class, what a profile holds): a restart with the same key sends it at once, any change
measures again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from nestling.edge.board_memory import available_bytes
from nestling.edge.emulation import EmulationTarget
from nestling.edge.procedures import ClientData
from nestling.edge.trainer import run_task
from nestling.errors import ConfigError, SpecError
from nestling.messages import Task
from nestling.models.zoo import build
from nestling.profiler.board_profile import (
    NARROW_WIDTH,
    BoardProfile,
    NarrowFigure,
    ProfileError,
    emulated_board_profile,
    measured_board_profile,
    narrow_spec,
    parse_board_profile,
)
from nestling.profiler.device import cpu_model, measure_gflops
from nestling.profiler.measure import interleaved_steps, profile_model
from nestling.profiler.speed import FLOPS_PER_MAC, TRAIN_OVER_FORWARD, MacCounter
from nestling.spec import SubmodelSpec
from nestling.strict_json import strict_dumps

log = logging.getLogger("nestling.agent")
CACHE_NAME = "board-profile.json"
# What a measured profile holds; part of the cache key, so a cache made before the narrow point (2) or the cost
# per task (3) existed is measured again rather than sent without it.
PROFILE_VERSION = 3


@dataclass(frozen=True)
class ProfileInputs:
    """What a board profile depends on; its `key` decides whether the cached one still holds."""

    spec: dict[str, Any]  # the fleet's full model (SubmodelSpec.to_dict)
    batch: int
    torch_device: str
    margin: float
    emulate: str | None = None  # the emulated class (its figures replace the measurement)

    def board(self) -> dict[str, Any]:
        """This board's identity: a profile measured elsewhere (a copied state folder) is not reused."""
        identity: dict[str, Any] = {
            "machine": platform.machine(),
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "memory": int(psutil.virtual_memory().total),
            "torch": torch.__version__,
            "device": self.torch_device,
        }
        if torch.device(self.torch_device).type == "cuda" and torch.cuda.is_available():
            identity["gpu"] = torch.cuda.get_device_name(torch.device(self.torch_device))
        return identity

    def key(self) -> str:
        material = {
            "version": PROFILE_VERSION,
            "spec": self.spec,
            "batch": self.batch,
            "margin": self.margin,
            "emulate": self.emulate,
            "board": self.board(),
        }
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


def available_memory(torch_device: str) -> int:
    """Bytes training may take now: free GPU memory on CUDA, else available RAM (Jetsons share it), capped
    by the memory cgroup the agent runs in (a container, a systemd MemoryMax=)."""
    if torch.device(torch_device).type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(torch_device))
        return int(free)
    return available_bytes()


def emulated_profile(inputs: ProfileInputs, target: EmulationTarget) -> BoardProfile:
    """The emulated board's figures: its GFLOP/s (or the speed its measured per-sample latency implies) and
    its training memory, so the server plans exactly what the emulation will pace."""
    spec = SubmodelSpec.from_dict(inputs.spec)
    figures = target.figures
    gflops = figures.sustained_gflops
    latency = (figures.block_latency_s or {}).get(spec.model.arch, (figures.block_latency_s or {}).get("*"))
    if latency is not None:  # seconds per training sample of the full model: the speed that implies
        macs = MacCounter((spec.model.in_channels, spec.model.image_size, spec.model.image_size))(spec)
        gflops = macs * FLOPS_PER_MAC * TRAIN_OVER_FORWARD / float(latency) / 1e9
    if gflops is None:
        raise ProfileError("gflops", f"emulated board {target.name} has no speed for {spec.model.arch}")
    memory = target.memory_bytes if target.memory_bytes is not None else available_memory(inputs.torch_device)
    return emulated_board_profile(spec, inputs.batch, gflops, memory, target.name, inputs.margin)


def measure_narrow(
    spec: SubmodelSpec, batch: int, torch_device: str, full_step_s: float, *, repeats: int, warmup: int
) -> NarrowFigure | None:
    """The narrower member's whole step: timed in turn with the full model's, its median ratio to the full
    step × the profile's full step, so a load that comes and goes during profiling does not bend the fixed
    cost. None when the family cannot build that width (the profile then predicts by MACs alone)."""
    try:
        narrow = narrow_spec(spec, NARROW_WIDTH)
        full, small = interleaved_steps(
            [spec, narrow], batch, torch_device, repeats=max(repeats, 3), warmup=warmup
        )
    except (SpecError, ConfigError) as exc:
        log.warning("no narrow point for %s at width %g: %s", spec.model.arch, NARROW_WIDTH, exc)
        return None
    ratio = statistics.median(s / f for s, f in zip(small, full) if f > 0)
    return NarrowFigure(NARROW_WIDTH, ratio * full_step_s)


def measure_task_s(
    spec: SubmodelSpec, batch: int, torch_device: str, step_s: float, *, repeats: int
) -> float:
    """Seconds a task of `spec` costs besides its steps: one-step tasks run as the agent runs them (building the
    slice, loading its weights, the optimizer, the first step's warm-up, copying the trained weights out) minus
    the profile's steady step; the median over `repeats`, kept in [0, the task's time]. Measured on the full
    model and used for every submodel (a narrower slice builds a little faster: this errs long, by milliseconds)."""
    generator = torch.Generator().manual_seed(0)
    model = spec.model
    shape = (batch, model.in_channels, model.image_size, model.image_size)
    data = ClientData(torch.randn(shape, generator=generator), torch.randint(0, model.num_classes, (batch,)))
    weights = build(spec).state_dict()
    hparams = {"local_steps": 1, "batch_size": batch, "lr": 0.0, "momentum": 0.9, "seed": 0}
    task = Task(0, "self-profile", spec.to_dict(), weights, "sgd", hparams=hparams, task_id="self-profile")
    seconds = [
        float(run_task(task, data, device=torch_device).metrics["train_seconds"]) for _ in range(repeats)
    ]
    whole = statistics.median(seconds)
    return min(max(whole - step_s, 0.0), whole)


def measure_profile(inputs: ProfileInputs, *, repeats: int = 5, warmup: int = 2) -> BoardProfile:
    """Measure the full model, its narrow point and the cost per task on this board (seconds on a small CPU;
    the worker is idle meanwhile)."""
    spec = SubmodelSpec.from_dict(inputs.spec)
    measured = profile_model(
        spec, inputs.batch, inputs.torch_device, repeats=repeats, warmup=warmup, rss_check=False
    )
    step_s = float(measured["total"]["step_ms"]["median"]) / 1000.0
    narrow = measure_narrow(spec, inputs.batch, inputs.torch_device, step_s, repeats=repeats, warmup=warmup)
    task_s = measure_task_s(spec, inputs.batch, inputs.torch_device, step_s, repeats=max(repeats, 3))
    gflops = float(measure_gflops(inputs.torch_device, seconds=0.5)["gflops"])
    return measured_board_profile(
        measured, gflops, available_memory(inputs.torch_device), inputs.margin, narrow, task_s
    )


def load_cached(path: Path, key: str) -> BoardProfile | None:
    """The cached profile when it was made for exactly these inputs, else None (absent, stale, unreadable)."""
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict) or stored.get("key") != key:
            return None
        return parse_board_profile(stored.get("profile"))
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable profile cache %s: %s", path, exc)
        return None


def save_cached(path: Path, key: str, profile: BoardProfile) -> None:
    """Write atomically: a power cut leaves the old cache or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(strict_dumps({"key": key, "profile": profile.to_dict()}, indent=1))
    os.replace(tmp, path)


def board_profile(
    inputs: ProfileInputs, cache: Path, target: EmulationTarget | None = None, *, repeats: int = 5
) -> tuple[BoardProfile, bool]:
    """(profile, measured now?): the cached one when its key matches, else a fresh one, cached."""
    key = inputs.key()
    cached = load_cached(cache, key)
    if cached is not None:
        return cached, False
    profile = (
        emulated_profile(inputs, target) if target is not None else measure_profile(inputs, repeats=repeats)
    )
    try:
        save_cached(cache, key, profile)
    except OSError as exc:  # a read-only state folder costs the cache, not the profile
        log.error("could not cache the board profile in %s: %s", cache, exc)
    return profile, True
