"""Per-part parameters, MACs and saved-activation bytes of a submodel, derived by running the model itself.

The submodel is built on the meta device and its tensors made FakeTensors on the CPU: they carry shapes,
dtypes and storages but no data, every op runs its meta kernel, and the CPU's kernel choices still hold (scaled-dot-product attention
takes the CPU flash path, which keeps q, k, v, its output and the log-sum-exp, where a plain meta tensor would
take the math path and keep the attention matrix). Its training forward and loss run once per probe batch
with forward pre-hooks labelling the part that runs, `saved_tensors_hooks` recording what autograd keeps
(once per storage: views of one buffer count once, a storage kept by two parts is listed under both) and a
dispatch mode counting multiply-accumulates of every op torch's flop counter knows. Nothing runs backward.

Saved bytes are affine in the batch (per-sample activations plus fixed BN statistics and loss scalars), so two
probe batches give every batch exactly. An op with no meta kernel falls back to a real run on two tiny CPU
batches (none of the registered families needs it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from nestling.models.net import ScalableNet
from nestling.models.zoo import build
from nestling.spec import SubmodelSpec

NO_META_KERNEL = (
    UnsupportedOperatorException,
    UnsupportedFakeTensorException,
    DynamicOutputShapeException,
    DataDependentOutputException,
)
PROBES = (2, 3)  # two batches fix the affine saved bytes; 2, not 1: training BN refuses one value per channel
_aten = torch.ops.aten
# The CPU flash kernel has the flash kernel's shapes and cost; torch's flop counter only lists the GPU ones.
_MAC_RULES: dict[Any, Callable[..., int]] = {
    **flop_registry,
    _aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[
        _aten._scaled_dot_product_flash_attention
    ],
}


@dataclass(frozen=True)
class PartParams:
    """One part of the submodel (stem, block i, exit i or head) and the tensors its module holds."""

    name: str
    kind: str
    index: int | None
    params: int
    trainable: int
    param_bytes: int  # parameters and buffers (running statistics, per-width statistics, counters)


@dataclass(frozen=True)
class PartTrace(PartParams):
    """A part with the multiply-accumulates its forward ran."""

    macs: int = 0  # forward, per sample


@dataclass(frozen=True)
class Saved:
    """Bytes autograd keeps at the two probe batches: per part, shared by two parts, in total."""

    parts: tuple[dict[str, int], dict[str, int]]
    shared: tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]
    total: tuple[int, int]


def _at(values: tuple[int, int], batch: int) -> int:
    """The affine figure through the two probes, at `batch` (exact for shapes linear in the batch)."""
    low, high = values
    return low + (high - low) * (batch - PROBES[0]) // (PROBES[1] - PROBES[0])


@dataclass(frozen=True)
class Trace:
    """What one submodel's training forward costs, part by part, at any batch."""

    spec: SubmodelSpec
    parts: tuple[PartTrace, ...]
    saved: Saved
    fallback: str | None  # the op that had no meta kernel, when the trace ran on real tensors

    def part_bytes(self, name: str, batch: int) -> int:
        return _at((self.saved.parts[0].get(name, 0), self.saved.parts[1].get(name, 0)), batch)

    def shared_bytes(self, first: str, second: str, batch: int) -> int:
        """Bytes kept by `second` and by `first`, the part that fed it (a block's output kept by its last ReLU
        and by the next block's first conv); only producer → consumer pairs are recorded."""
        key = (first, second)
        return _at((self.saved.shared[0].get(key, 0), self.saved.shared[1].get(key, 0)), batch)

    def total_bytes(self, batch: int) -> int:
        return _at(self.saved.total, batch)


def model_parts(net: ScalableNet) -> list[tuple[str, str, int | None, nn.Module]]:
    """(name, kind, index, module) in execution order, an exit right after its block."""
    parts: list[tuple[str, str, int | None, nn.Module]] = [("stem", "stem", None, net.stem)]
    for i, block in enumerate(net.blocks):
        parts.append((f"block{i}", "block", i, block))
        if str(i) in net.exits:
            parts.append((f"exit{i}", "exit", i, net.exits[str(i)]))
    if net.head is not None:
        parts.append(("head", "head", None, net.head))
    return parts


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of the storage behind a tensor: views of one buffer share it (fake tensors too)."""
    storage = tensor.untyped_storage()
    return storage._cdata, storage.nbytes()


class _Running:
    """The part whose forward (or loss) runs now: forward pre-hooks move it along."""

    def __init__(self) -> None:
        self.label = "input"


class _MacCounter(TorchDispatchMode):
    """Multiply-accumulates of every op with a known cost rule, charged to the running part."""

    def __init__(self, running: _Running) -> None:
        super().__init__()
        self.running = running
        self.macs: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rule = _MAC_RULES.get(func._overloadpacket)
        if rule is not None:
            flops = int(rule(*args, **kwargs, out_val=out))
            label = self.running.label
            self.macs[label] = self.macs.get(label, 0) + flops // 2
        return out


def _run(
    net: ScalableNet, spec: SubmodelSpec, batch: int, *, count_macs: bool
) -> tuple[dict[str, dict[int, int]], dict[str, int]]:
    """One training forward and loss at `batch`: storages saved per part, and (when asked) MACs per part."""
    excluded = {_storage(t)[0] for t in [*net.parameters(), *net.buffers()]}
    saved: dict[str, dict[int, int]] = {}
    alive: list[torch.Tensor] = []  # storages stay allocated, so no identity is reused during the pass
    running = _Running()
    counter = _MacCounter(running) if count_macs else contextlib.nullcontext()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key, nbytes = _storage(tensor)
        if key not in excluded:
            saved.setdefault(running.label, {})[key] = nbytes
        alive.append(tensor)
        return tensor

    def enter(name: str) -> Callable[..., None]:
        return lambda _module, _inputs: setattr(running, "label", name)

    handles = [module.register_forward_pre_hook(enter(name)) for name, _, _, module in model_parts(net)]
    model = spec.model
    try:
        x = torch.zeros(batch, model.in_channels, model.image_size, model.image_size)
        y = torch.zeros(batch, dtype=torch.long)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
            outputs = net.forward_all(x)
            labels = [f"exit{k}" for k in net.exits] + (["head"] if net.head is not None else [])
            for label, logits in zip(labels, outputs):
                running.label = label  # each output's loss is charged to the part that produced it
                F.cross_entropy(logits, y)
    finally:
        for handle in handles:
            handle.remove()
    return saved, counter.macs if isinstance(counter, _MacCounter) else {}


def producers(parts: list[tuple[str, str, int | None, nn.Module]]) -> dict[str, str]:
    """The part whose output each part consumes: the stem or the previous block (exits do not feed blocks)."""
    out: dict[str, str] = {}
    last: str | None = None
    for name, kind, _, _ in parts:
        if last is not None:
            out[name] = last
        if kind in ("stem", "block"):
            last = name
    return out


def _saved(runs: list[dict[str, dict[int, int]]], names: list[str], feeds: dict[str, str]) -> Saved:
    parts, shared, total = [], [], []
    for saved in runs:
        parts.append({name: sum(saved.get(name, {}).values()) for name in names})
        pairs: dict[tuple[str, str], int] = {}
        for name, source in feeds.items():
            mine, theirs = saved.get(name, {}), saved.get(source, {})
            pairs[(source, name)] = sum(size for key, size in mine.items() if key in theirs)
        shared.append(pairs)
        unique: dict[int, int] = {}
        for storages in saved.values():
            unique.update(storages)
        total.append(sum(unique.values()))
    return Saved((parts[0], parts[1]), (shared[0], shared[1]), (total[0], total[1]))


def _part_params(net: ScalableNet) -> list[PartParams]:
    return [
        PartParams(
            name,
            kind,
            index,
            sum(p.numel() for p in module.parameters()),
            sum(p.numel() for p in module.parameters() if p.requires_grad),
            sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]),
        )
        for name, kind, index, module in model_parts(net)
    ]


@lru_cache(maxsize=4096)
def part_params(spec: SubmodelSpec) -> tuple[PartParams, ...]:
    """Parameters of every part from a build on the meta device, without running it (a ScaleFL split search
    counts a hundred widths)."""
    with _quiet_rng():
        return tuple(_part_params(build(spec, device="meta", init=False)))


@contextmanager
def _quiet_rng() -> Iterator[None]:
    """Building draws initial weights; a trace must not move the run's random stream."""
    with torch.random.fork_rng(devices=[]):
        yield


def _fake_cpu(net: ScalableNet, mode: FakeTensorMode) -> ScalableNet:
    """`net` (built on the meta device, which is fast) with every parameter and buffer a data-less CPU tensor."""
    cpu = torch.device("cpu")
    for module in net.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                fake = FakeTensor(mode, param.data, cpu)
                module._parameters[name] = nn.Parameter(fake, requires_grad=param.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = FakeTensor(mode, buffer, cpu)
    return net


def _trace_on(spec: SubmodelSpec, fake: bool) -> Trace:
    mode = FakeTensorMode() if fake else None
    with _quiet_rng():
        net = _fake_cpu(build(spec, device="meta", init=False), mode) if mode is not None else build(spec)
        net.train()
        runs, macs = [], {}
        for batch in PROBES:
            last = batch == PROBES[-1]
            with mode if mode is not None else contextlib.nullcontext():
                saved, counted = _run(net, spec, batch, count_macs=last)
            runs.append(saved)
            if last:
                macs = counted
    parts = tuple(PartTrace(**vars(p), macs=macs.get(p.name, 0) // PROBES[-1]) for p in _part_params(net))
    names = model_parts(net)
    return Trace(
        spec, parts, _saved(runs, [n for n, _, _, _ in names], producers(names)), None if fake else "real"
    )


@lru_cache(maxsize=4096)
def trace(spec: SubmodelSpec) -> Trace:
    """The cached trace of `spec` (batch-independent: saved bytes come at any batch from the two probes)."""
    try:
        return _trace_on(spec, fake=True)
    except NO_META_KERNEL as error:  # an op without a meta kernel: run it for real on tiny batches
        real = _trace_on(spec, fake=False)
        return Trace(real.spec, real.parts, real.saved, f"real CPU batches {PROBES} ({error})")
