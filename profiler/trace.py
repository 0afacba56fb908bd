"""Per-part parameters, MACs and saved-activation bytes of a submodel, derived by running the model itself.

The submodel is built on the meta device and each part runs on meta tensors: they carry shapes, dtypes and
storages but no data. Where the CPU's kernel choice changes what autograd keeps, the CPU's choice is taken:
scaled-dot-product attention runs the CPU flash kernel (it keeps q, k, v, its output and the log-sum-exp;
meta alone would take the math path and keep the attention matrix). Each part (stem, block i, exit i with
its loss, head with its loss) runs its training forward alone on a fresh input of the shape the previous
part emitted, with `saved_tensors_hooks` recording what autograd keeps by storage (views of one buffer count
once) and a dispatch mode counting multiply-accumulates of every op torch's flop counter knows. Nothing runs
backward. The chain then adds the parts up as one forward keeps them: the tensor between two parts is one
storage (kept by a block's last ReLU and by the next block's first conv: counted once in the total, listed
under both parts), and the int64 labels every output's loss keeps are one tensor.

Two caches keep this cheap. A part's run is cached by its module tree's signature (types, plain attributes,
tensor shapes) and its input, so alike blocks of one model, and the same block of two specs, run once. Below
autograd, an op that returns only new tensors runs its meta kernel once per input geometry and is answered
by fresh meta tensors of the same shapes after (training batch norm's Python meta kernel alone costs
~15-30 ms a call). Saved bytes are affine in the batch (per-sample activations plus fixed BN statistics and
loss scalars), so two probe batches give every batch exactly. An op with no meta kernel makes the trace run
on real CPU tensors at the probe batches instead (none of the registered families needs it).
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
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from nestling.models.net import ScalableNet
from nestling.models.zoo import build
from nestling.spec import SubmodelSpec

PROBES = (2, 3)  # two batches fix the affine saved bytes; 2, not 1: training BN refuses one value per channel
_aten = torch.ops.aten
_FLASH_CHOICE = torch._C._SDPBackend.FLASH_ATTENTION.value  # what _fused_sdp_choice answers for flash
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


_OpKey = tuple[Any, ...]
_OutMeta = tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...]
_OP_OUTPUTS: dict[
    _OpKey, tuple[_OutMeta, int]
] = {}  # an op on inputs of these shapes -> its outputs, its MACs
_MAX_OP_OUTPUTS = 200_000
_FRESH_OUTPUTS: dict[Any, bool] = {}  # op -> it returns only new tensors (no view, no in-place result)


def _fresh_outputs(func: Any) -> bool:
    """Whether `func` returns only new tensors, so fresh tensors of its output shapes stand in for it on meta."""
    known = _FRESH_OUTPUTS.get(func)
    if known is None:
        returns = func._schema.returns
        known = bool(returns) and all(
            r.alias_info is None and isinstance(r.type, torch.TensorType) for r in returns
        )
        _FRESH_OUTPUTS[func] = known
    return known


def _arg_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.shape, value.stride(), value.dtype, value.storage_offset(), value.device.type)
    if isinstance(value, (list, tuple)):
        return (type(value), *(_arg_key(v) for v in value))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return (type(value), value)


class _CpuAttention(TorchFunctionMode):
    """Attention as the CPU runs it: meta tensors would take the math path (which keeps the attention matrix),
    the CPU's flash kernel keeps q, k, v, its output and the log-sum-exp; its choice is asked on empty CPU
    tensors of the same shapes."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and args[0].device.type == "meta":
            cpu = [torch.empty(a.shape, dtype=a.dtype).requires_grad_(a.requires_grad) for a in args[:3]]
            if int(_aten._fused_sdp_choice(*cpu, *args[3:], **kwargs)) == _FLASH_CHOICE:
                return _aten._scaled_dot_product_flash_attention_for_cpu(*args, **kwargs)[0]
        return func(*args, **kwargs)


class _MetaOps(TorchDispatchMode):
    """Runs a part's ops on meta tensors as the CPU would choose them, counting multiply-accumulates.

    An op that returns only new tensors runs once per input geometry: later calls get fresh meta tensors of
    the shapes it gave (training batch norm's Python meta kernel alone costs ~30 ms a call). Views and
    in-place ops always run (their outputs share their inputs' storages, which the saved-bytes count follows)."""

    def __init__(self) -> None:
        super().__init__()
        self.macs = 0
        self.math_attention = False  # meta took attention's math path (its safe softmax ran)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten._safe_softmax.default:
            self.math_attention = True
        if not _fresh_outputs(func):
            out = func(*args, **kwargs)
            self.macs += self._macs(func, args, kwargs, out)
            return out
        key = (func, _arg_key(args), _arg_key(kwargs))
        known = _OP_OUTPUTS.get(key)
        if known is not None:
            shapes, macs = known
            self.macs += macs
            made = tuple(torch.empty_strided(s, st, dtype=d, device="meta") for s, st, d in shapes)
            return made if len(func._schema.returns) > 1 else made[0]
        out = func(*args, **kwargs)
        macs = self._macs(func, args, kwargs, out)
        self.macs += macs
        outs = out if isinstance(out, tuple) else (out,)
        stand_ins = [torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device="meta") for o in outs]
        # cached only when fresh tensors of those shapes have the same storages (size, none shared, offset 0)
        if (
            all(o.device.type == "meta" for o in outs)
            and len({_storage(o)[0] for o in outs}) == len(outs)
            and all(
                o.storage_offset() == 0 and _storage(o)[1] == _storage(n)[1] for o, n in zip(outs, stand_ins)
            )
        ):
            if len(_OP_OUTPUTS) >= _MAX_OP_OUTPUTS:
                _OP_OUTPUTS.clear()
            _OP_OUTPUTS[key] = (tuple((tuple(o.shape), o.stride(), o.dtype) for o in outs), macs)
        return out

    @staticmethod
    def _macs(func: Any, args: Any, kwargs: Any, out: Any) -> int:
        rule = _MAC_RULES.get(func._overloadpacket)
        return int(rule(*args, **kwargs, out_val=out)) // 2 if rule is not None else 0


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
    device: str,
    cpu_attention: bool = False,
) -> _PartRun:
    """Run `module` alone on a fresh input: what autograd keeps, by storage, and its MACs. A part in which meta
    took attention's math path runs again with the CPU's attention (the mode that asks costs every part
    ~20 %, so only parts with attention pay it)."""
    excluded = {_storage(t)[0] for t in [*module.parameters(), *module.buffers()]}
    saved: dict[int, int] = {}
    alive: list[torch.Tensor] = []  # storages stay allocated, so no identity is reused during the run

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key, nbytes = _storage(tensor)
        if key not in excluded:
            saved[key] = nbytes
        alive.append(tensor)
        return tensor

    ops = _MetaOps()
    x = torch.zeros(shape, dtype=dtype, device=device, requires_grad=grad)
    y = torch.zeros(shape[0], dtype=torch.long, device=device)
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    attention = _CpuAttention() if cpu_attention else contextlib.nullcontext()
    with torch.enable_grad(), hooks, attention, ops:
        out = module(x)
        if loss:
            F.cross_entropy(out, y)
    if ops.math_attention and not cpu_attention:
        return _run_part(module, shape, dtype, grad, loss, device, cpu_attention=True)
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
        macs=ops.macs,
        out_shape=tuple(out.shape),
        out_dtype=out.dtype,
        out_bytes=out_bytes,
    )


def _part_run(
    module: nn.Module, shape: tuple[int, ...], dtype: torch.dtype, grad: bool, loss: bool, device: str
) -> _PartRun:
    """`_run_part`, cached by the part's signature: alike blocks of one model, or of two specs, run once."""
    key = (_signature(module), shape, dtype, grad, loss, device)
    run = _PART_RUNS.get(key)
    if run is None:
        run = _run_part(module, shape, dtype, grad, loss, device)
        if len(_PART_RUNS) >= _MAX_PART_RUNS:
            _PART_RUNS.clear()
        _PART_RUNS[key] = run
    return run


def _chain(
    net: ScalableNet, spec: SubmodelSpec, batch: int, device: str
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
        run = _part_run(module, shape, dtype, grad, kind in ("exit", "head"), device)
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


def _trace_on(spec: SubmodelSpec, device: str) -> Trace:
    with _quiet_rng():
        net = build(spec, device=device, init=device != "meta")
        net.train()
        low, high = (_chain(net, spec, batch, device) for batch in PROBES)
    params = _part_params(net)
    parts = tuple(PartTrace(**vars(p), macs=high[3].get(p.name, 0) // PROBES[-1]) for p in params)
    saved = Saved((low[0], high[0]), (low[1], high[1]), (low[2], high[2]))
    return Trace(spec, parts, saved, None if device == "meta" else "real")


@lru_cache(maxsize=4096)
def trace(spec: SubmodelSpec) -> Trace:
    """The cached trace of `spec` (batch-independent: saved bytes come at any batch from the two probes)."""
    try:
        return _trace_on(spec, "meta")
    except NotImplementedError as error:  # an op without a meta kernel: run it for real on tiny batches
        real = _trace_on(spec, "cpu")
        return Trace(real.spec, real.parts, real.saved, f"real CPU batches {PROBES} ({error})")
