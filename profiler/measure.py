"""Measured per-part profile of one submodel on this machine: latency, memory split, whole-step peak."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nestling.errors import ConfigError
from nestling.models.net import ScalableNet
from nestling.models.zoo import build
from nestling.profiler.memory import (
    SavedTensorMeter,
    gradient_bytes,
    model_tensors,
    optimizer_bytes,
    parameter_bytes,
    return_freed_memory_to_os,
    rss_bytes,
)
from nestling.spec import SubmodelSpec

SCHEMA = "nestling.profile/1"


@dataclass(frozen=True)
class Part:
    """One timed and metered piece of a ScalableNet: the stem, a block, an exit or the head."""

    name: str
    kind: str
    index: int | None
    module: nn.Module


def model_parts(net: ScalableNet) -> list[Part]:
    """Parts in execution order (an exit right after its block)."""
    parts = [Part("stem", "stem", None, net.stem)]
    for i, block in enumerate(net.blocks):
        parts.append(Part(f"block{i}", "block", i, block))
        if str(i) in net.exits:
            parts.append(Part(f"exit{i}", "exit", i, net.exits[str(i)]))
    if net.head is not None:
        parts.append(Part("head", "head", None, net.head))
    return parts


def producers(parts: list[Part]) -> dict[str, str | None]:
    """The part whose output each part consumes: the stem or the previous block (exits do not feed blocks)."""
    out: dict[str, str | None] = {}
    last: str | None = None
    for part in parts:
        out[part.name] = last
        if part.kind in ("stem", "block"):
            last = part.name
    return out


def latency_summary(seconds: list[float]) -> dict[str, float | int]:
    """Median and p90 in milliseconds of the timed repeats (warm-up already dropped)."""
    ms = np.asarray(seconds) * 1000.0
    return {"median": float(np.median(ms)), "p90": float(np.percentile(ms, 90)), "samples": len(ms)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def output_labels(net: ScalableNet) -> list[str]:
    """Part name of each forward_all output: exits in depth order, then the head."""
    return [f"exit{k}" for k in net.exits] + (["head"] if net.head is not None else [])


def _training_loss(
    net: ScalableNet, x: torch.Tensor, y: torch.Tensor, meter: SavedTensorMeter | None = None
) -> torch.Tensor:
    """Sum of every output's cross-entropy; the meter charges each loss to the part that produced its logits."""
    total = x.new_zeros(())
    for label, out in zip(output_labels(net), net.forward_all(x)):
        if meter is None:
            total = total + F.cross_entropy(out, y)
        else:
            with meter.part(label):
                total = total + F.cross_entropy(out, y)
    return total


def _part_inputs(net: ScalableNet, parts: list[Part], x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensor each part receives in a forward pass, detached."""
    captured: dict[str, torch.Tensor] = {}
    handles = [
        p.module.register_forward_pre_hook(
            lambda _m, inputs, name=p.name: captured.__setitem__(name, inputs[0].detach().clone())
        )
        for p in parts
    ]
    try:
        with torch.no_grad():
            net.forward_all(x)
    finally:
        for h in handles:
            h.remove()
    return captured


def _time_part(
    part: Part, inp: torch.Tensor, repeats: int, warmup: int, device: torch.device
) -> tuple[list[float], list[float], int | None]:
    """Forward and backward seconds of one part alone; its input needs a gradient unless it is the image."""
    inp = inp.clone().requires_grad_(part.kind != "stem")
    forward, backward = [], []
    cuda_peak: int | None = None
    for i in range(warmup + repeats):
        part.module.zero_grad(set_to_none=True)
        inp.grad = None
        if device.type == "cuda" and i == warmup:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        _sync(device)
        t0 = time.perf_counter()
        out = part.module(inp)
        _sync(device)
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out))
        _sync(device)
        t2 = time.perf_counter()
        if i >= warmup:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
        if device.type == "cuda" and i == warmup:
            cuda_peak = int(torch.cuda.max_memory_allocated(device) - base)
    part.module.zero_grad(set_to_none=True)
    return forward, backward, cuda_peak


class _Step:
    """One SGD-with-momentum training step of the whole submodel (the optimizer state a board keeps)."""

    def __init__(
        self, net: ScalableNet, x: torch.Tensor, y: torch.Tensor, lr: float, momentum: float
    ) -> None:
        self.net, self.x, self.y = net, x, y
        self.params = [p for p in net.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=momentum)

    def __call__(
        self, meter: SavedTensorMeter | None = None, after_forward: Callable[[], None] | None = None
    ) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if meter is not None:
            with meter:
                loss = _training_loss(self.net, self.x, self.y, meter)
        else:
            loss = _training_loss(self.net, self.x, self.y)
        if after_forward is not None:
            after_forward()
        loss.backward()
        self.optimizer.step()


def _rss_check(step: _Step, activations: int) -> dict[str, Any]:
    """RSS growth over a forward pass (graph alive) against the metered saved-activation bytes."""
    step()
    step.optimizer.zero_grad(set_to_none=True)
    exact = return_freed_memory_to_os()
    before = rss_bytes()
    seen: list[int] = []
    step(after_forward=lambda: seen.append(rss_bytes()))
    delta = seen[0] - before
    return {
        "forward_delta_bytes": int(delta),
        "ratio_to_activations": delta / activations if activations else None,
        "malloc_returns_memory": exact,
        "process_bytes": rss_bytes(),
    }


def interleaved_steps(
    specs: Sequence[SubmodelSpec],
    batch: int = 32,
    device: str | torch.device = "cpu",
    repeats: int = 10,
    warmup: int = 3,
    *,
    lr: float = 0.01,
    momentum: float = 0.9,
    seed: int = 0,
) -> list[list[float]]:
    """Seconds of one whole training step of each spec, per repeat, the specs timed in turn (a, b, a, b, ...).

    On a shared or throttling board the load comes and goes between two separate profiles; timed in turn, it
    falls on every spec alike, so the ratio of two specs' steps holds where their separate medians drift."""
    if not specs or batch < 2 or repeats < 1 or warmup < 0:
        raise ConfigError(
            f"interleaved steps need specs, batch >= 2, repeats >= 1, warmup >= 0 "
            f"(got {len(specs)} specs, {batch}, {repeats}, {warmup})"
        )
    dev = torch.device(device)
    torch.manual_seed(seed)
    steps = []
    for spec in specs:
        net = build(spec, device=dev)
        net.train()
        model = spec.model
        x = torch.randn(batch, model.in_channels, model.image_size, model.image_size, device=dev)
        y = torch.randint(0, model.num_classes, (batch,), device=dev)
        steps.append(_Step(net, x, y, lr, momentum))
    seconds: list[list[float]] = [[] for _ in specs]
    for i in range(warmup + repeats):
        for k, step in enumerate(steps):
            _sync(dev)
            t0 = time.perf_counter()
            step()
            _sync(dev)
            if i >= warmup:
                seconds[k].append(time.perf_counter() - t0)
    return seconds


def profile_model(
    spec: SubmodelSpec,
    batch: int = 32,
    device: str | torch.device = "cpu",
    repeats: int = 10,
    warmup: int = 3,
    *,
    lr: float = 0.01,
    momentum: float = 0.9,
    seed: int = 0,
    rss_check: bool = True,
) -> dict[str, Any]:
    """Profile of training `spec` at `batch` on `device`: per part latency and memory, whole-step totals."""
    if batch < 2 or repeats < 1 or warmup < 0:
        raise ConfigError(
            f"profile needs batch >= 2, repeats >= 1, warmup >= 0 (got {batch}, {repeats}, {warmup})"
        )
    dev = torch.device(device)
    torch.manual_seed(seed)
    net = build(spec, device=dev)
    net.train()
    model = spec.model
    x = torch.randn(batch, model.in_channels, model.image_size, model.image_size, device=dev)
    y = torch.randint(0, model.num_classes, (batch,), device=dev)
    parts = model_parts(net)
    step = _Step(net, x, y, lr, momentum)
    step_seconds = []
    for i in range(warmup + repeats):
        _sync(dev)
        t0 = time.perf_counter()
        step()
        _sync(dev)
        if i >= warmup:
            step_seconds.append(time.perf_counter() - t0)
    # Memory of one step after warm-up: momentum buffers exist, gradients are re-created by backward.
    meter = SavedTensorMeter(model_tensors(net))
    handles = meter.attach((p.name, p.module) for p in parts)
    cuda_step_peak = None
    try:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        step(meter)
        if dev.type == "cuda":
            cuda_step_peak = int(torch.cuda.max_memory_allocated(dev) - base)
    finally:
        for h in handles:
            h.remove()
    total: dict[str, Any] = {
        "params_bytes": parameter_bytes(net),
        "grads_bytes": gradient_bytes(step.params),
        "optimizer_bytes": optimizer_bytes(step.optimizer),
        "activations_bytes": meter.total_bytes,
    }
    total["peak_training_bytes"] = sum(total.values())
    memories = []
    feeds = producers(parts)
    for part in parts:
        params = [p for p in part.module.parameters() if p.requires_grad]
        memory: dict[str, Any] = {
            "params_bytes": parameter_bytes(part.module),
            "grads_bytes": gradient_bytes(params),
            "optimizer_bytes": optimizer_bytes(step.optimizer, params),
            "activations_bytes": meter.bytes_of(part.name),
        }
        memory["training_bytes"] = sum(memory.values())
        source = feeds[part.name]
        memory["input_shared_bytes"] = meter.shared_bytes(source, part.name) if source else 0
        memories.append(memory)
    inputs = _part_inputs(net, parts, x)
    records = []
    for part, memory in zip(parts, memories):
        forward, backward, cuda_peak = _time_part(part, inputs[part.name], repeats, warmup, dev)
        memory["cuda_peak_bytes"] = cuda_peak
        records.append(
            {
                "name": part.name,
                "kind": part.kind,
                "index": part.index,
                "params": sum(p.numel() for p in part.module.parameters()),
                "forward_ms": latency_summary(forward),
                "backward_ms": latency_summary(backward),
                "memory": memory,
            }
        )
    total["step_ms"] = latency_summary(step_seconds)
    total["cuda_peak_bytes"] = cuda_step_peak
    total["rss"] = _rss_check(step, meter.total_bytes) if rss_check and dev.type == "cpu" else None
    return {
        "schema": SCHEMA,
        "model": {
            "arch": model.arch,
            "spec": spec.to_dict(),
            "spec_id": spec.id,
            "batch": batch,
            "input_shape": [model.in_channels, model.image_size, model.image_size],
            "device": str(dev),
            "dtype": "float32",
            "optimizer": {"name": "sgd", "lr": lr, "momentum": momentum},
            "repeats": repeats,
            "warmup": warmup,
        },
        "parts": records,
        "total": total,
    }
