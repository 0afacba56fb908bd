"""Per-part parameters, MACs and saved-activation bytes of a submodel, derived by running the model itself.

The submodel is built on the meta device and a part's tensors are made FakeTensors on the CPU when it runs: they
carry shapes, dtypes and storages but no data, every op runs its meta kernel, and the CPU's kernel choices still
hold (scaled-dot-product attention takes the CPU flash path, which keeps q, k, v, its output and the log-sum-exp,
where a plain meta tensor would take the math path and keep the attention matrix). Each part (stem, block i,
exit i with its loss, head with its loss) runs its training forward alone on a fresh input of the shape the
previous part emitted, with `saved_tensors_hooks` recording what autograd keeps by storage (views of one buffer
count once) and a dispatch mode counting multiply-accumulates of every op torch's flop counter knows. Nothing
runs backward. The chain then adds the parts up as one forward keeps them: the tensor between two parts is one
storage (kept by a block's last ReLU and by the next block's first conv: counted once in the total, listed under
both parts), and the int64 labels every output's loss keeps are one tensor.

A part's run is cached by its module tree's signature (types, plain attributes, tensor shapes) and its input,
so alike blocks of one model, and the same block of two specs, run once. Saved bytes are affine in the batch
(per-sample activations plus fixed BN statistics and loss scalars), so two probe batches give every batch
exactly. An op with no meta kernel makes the trace run on real CPU tensors at the probe batches instead (none
of the registered families needs it).
"""

from __future__ import annotations

import contextlib
import math
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


@dataclass(frozen=True)
class _PartRun:
    """What one part keeps when it runs alone on an input of one shape (its loss included for an output)."""

    internal: int  # bytes of saved storages that are neither the input's, the output's nor the labels'
    saves_input: bool
    saves_output: bool  # the output's own storage (not the input's) is kept by this part
    output_is_input: bool  # the part returned its input's storage (an identity, or a view of it)
    labels: int  # bytes of the int64 labels its loss keeps (one tensor shared by every output's loss)
    macs: int
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    out_bytes: int


_PART_RUNS: dict[tuple[Any, ...], _PartRun] = {}
_MAX_PART_RUNS = 50_000


def _signature(module: nn.Module) -> tuple[Any, ...]:
    """What decides a part's forward: every submodule's type, plain attributes, mode and tensor shapes."""
    items: list[Any] = []
    for name, sub in module.named_modules():
        attrs = []
        for key, value in vars(sub).items():
            if key.startswith("_"):
                continue
            try:
                hash(value)
            except TypeError:
                value = repr(value)
            attrs.append((key, value))
        tensors = tuple(
            (key, tuple(t.shape), t.dtype, t.requires_grad)
            for key, t in [*sub._parameters.items(), *sub._buffers.items()]
            if t is not None
        )
        items.append((name, type(sub), tuple(attrs), tensors))
    return tuple(items)


def _run_part(
    module: nn.Module,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    grad: bool,
    loss: bool,
    mode: FakeTensorMode | None,
) -> _PartRun:
    """Run `module` alone on a fresh input: what autograd keeps, by storage, and its MACs."""
    excluded = {_storage(t)[0] for t in [*module.parameters(), *module.buffers()]}
    saved: dict[int, int] = {}
    alive: list[torch.Tensor] = []  # storages stay allocated, so no identity is reused during the run

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key, nbytes = _storage(tensor)
        if key not in excluded:
            saved[key] = nbytes
        alive.append(tensor)
        return tensor

    counter = (
        _MacCounter(_Running()) if shape[0] == PROBES[-1] else contextlib.nullcontext()
    )  # MACs at one probe
    with mode if mode is not None else contextlib.nullcontext():
        x = torch.zeros(shape, dtype=dtype, requires_grad=grad)
        y = torch.zeros(shape[0], dtype=torch.long)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
            out = module(x)
            if loss:
                F.cross_entropy(out, y)
    x_key, _ = _storage(x)
    out_key, out_bytes = _storage(out)
    y_key, y_bytes = _storage(y)
    special = {x_key, out_key, y_key}
    return _PartRun(
        internal=sum(size for key, size in saved.items() if key not in special),
        saves_input=x_key in saved,
        saves_output=out_key != x_key and out_key in saved,
        output_is_input=out_key == x_key,
        labels=y_bytes if y_key in saved else 0,
        macs=counter.macs.get("input", 0) if isinstance(counter, _MacCounter) else 0,
        out_shape=tuple(out.shape),
        out_dtype=out.dtype,
        out_bytes=out_bytes,
    )


def _part_run(
    module: nn.Module,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    grad: bool,
    loss: bool,
    mode: FakeTensorMode | None,
) -> _PartRun:
    """`_run_part`, cached by the part's signature: alike blocks of one model, or of two specs, run once."""
    key = (_signature(module), shape, dtype, grad, loss, mode is None)
    run = _PART_RUNS.get(key)
    if run is None:
        if mode is not None:
            _fake_cpu(module, mode)
        run = _run_part(module, shape, dtype, grad, loss, mode)
        if len(_PART_RUNS) >= _MAX_PART_RUNS:
            _PART_RUNS.clear()
        _PART_RUNS[key] = run
    return run


def _chain(
    net: ScalableNet, spec: SubmodelSpec, batch: int, mode: FakeTensorMode | None
) -> tuple[dict[str, int], dict[tuple[str, str], int], int, dict[str, int]]:
    """The submodel at `batch`, part after part: bytes per part, bytes shared with its producer, total; MACs."""
    model = spec.model
    shape: tuple[int, ...] = (batch, model.in_channels, model.image_size, model.image_size)
    dtype, grad = torch.float32, False
    tensor = 0  # the connecting tensor between parts, by id; sizes holds its storage's bytes
    sizes: dict[int, int] = {tensor: 4 * math.prod(shape)}
    savers: dict[int, set[str]] = {}
    parts: dict[str, int] = {}
    internal = labels = 0
    macs: dict[str, int] = {}
    for name, kind, _, module in model_parts(net):
        run = _part_run(module, shape, dtype, grad, kind in ("exit", "head"), mode)
        out = tensor if run.output_is_input else len(sizes)
        sizes.setdefault(out, run.out_bytes)
        mine = run.internal + run.labels
        if run.saves_input:
            savers.setdefault(tensor, set()).add(name)
            mine += sizes[tensor]
        if run.saves_output:
            savers.setdefault(out, set()).add(name)
            mine += sizes[out]
        parts[name] = mine
        internal += run.internal
        labels = max(labels, run.labels)
        macs[name] = run.macs
        if kind in ("stem", "block"):
            grad = grad or any(p.requires_grad for p in module.parameters())
            tensor, shape, dtype = out, run.out_shape, run.out_dtype
    shared: dict[tuple[str, str], int] = {}
    for name, source in producers(model_parts(net)).items():
        shared[(source, name)] = sum(sizes[t] for t, who in savers.items() if name in who and source in who)
    total = internal + labels + sum(sizes[t] for t in savers)
    return parts, shared, total, macs


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


def _fake_cpu(part: nn.Module, mode: FakeTensorMode) -> None:
    """`part` (built on the meta device, which is fast) with every parameter and buffer a data-less CPU tensor."""
    cpu = torch.device("cpu")
    for module in part.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.device.type == "meta":
                fake = FakeTensor(mode, param.data, cpu)
                module._parameters[name] = nn.Parameter(fake, requires_grad=param.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device.type == "meta":
                module._buffers[name] = FakeTensor(mode, buffer, cpu)


def _trace_on(spec: SubmodelSpec, fake: bool) -> Trace:
    mode = FakeTensorMode() if fake else None
    with _quiet_rng():
        net = build(spec, device="meta" if fake else None, init=not fake)
        net.train()
        low, high = (_chain(net, spec, batch, mode) for batch in PROBES)
    params = _part_params(net)
    parts = tuple(PartTrace(**vars(p), macs=high[3].get(p.name, 0) // PROBES[-1]) for p in params)
    saved = Saved((low[0], high[0]), (low[1], high[1]), (low[2], high[2]))
    return Trace(spec, parts, saved, None if fake else "real")


@lru_cache(maxsize=4096)
def trace(spec: SubmodelSpec) -> Trace:
    """The cached trace of `spec` (batch-independent: saved bytes come at any batch from the two probes)."""
    try:
        return _trace_on(spec, fake=True)
    except NO_META_KERNEL as error:  # an op without a meta kernel: run it for real on tiny batches
        real = _trace_on(spec, fake=False)
        return Trace(real.spec, real.parts, real.saved, f"real CPU batches {PROBES} ({error})")
