"""Symbolic forward pass of a model: each op's parameters, MACs and what autograd keeps, without tensors.

`Walk` provides the ops; each model family's `walk` (nestling/models/family.py) runs its forward through
them. tests/nestling/models/test_families.py holds every registered family's walk to its real module
(parameters, MACs and saved activation bytes equal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nestling.errors import SpecError
from nestling.models.family import family_of
from nestling.models.layers import kept_channels
from nestling.models.net import BlockInfo
from nestling.spec import SubmodelSpec

FLOAT, INDEX = 4, 8


class Sym:
    """A tensor of the walk: per-sample shape (or a fixed shape, e.g. BN statistics) and element size."""

    __slots__ = ("fixed", "itemsize", "shape")

    def __init__(self, shape: tuple[int, ...], itemsize: int = FLOAT, fixed: bool = False) -> None:
        self.shape, self.itemsize, self.fixed = shape, itemsize, fixed

    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class PartRecord:
    name: str
    kind: str
    index: int | None
    params: int = 0
    trainable: int = 0
    param_bytes: int = 0
    macs: int = 0


class Walk:
    """Runs `spec`'s forward symbolically at `batch`; `records` and saved bytes per part afterwards."""

    def __init__(self, spec: SubmodelSpec, batch: int) -> None:
        self.spec, self.batch, self.model = spec, batch, spec.model
        self.records: list[PartRecord] = []
        self._saved: dict[str, dict[int, int]] = {}
        self._alive: list[Sym] = []  # keeps ids unique for the walk's lifetime
        self.cur = PartRecord("input", "input", None)
        self._targets: Sym | None = None

    # -- bookkeeping --------------------------------------------------------------------------
    def begin(self, name: str, kind: str, index: int | None = None) -> None:
        self.cur = PartRecord(name, kind, index)
        self.records.append(self.cur)

    def new(self, shape: tuple[int, ...], itemsize: int = FLOAT, fixed: bool = False) -> Sym:
        t = Sym(tuple(int(s) for s in shape), itemsize, fixed)
        self._alive.append(t)
        return t

    def nbytes(self, t: Sym) -> int:
        return t.numel() * t.itemsize * (1 if t.fixed else self.batch)

    def save(self, *tensors: Sym) -> None:
        for t in tensors:
            self._saved.setdefault(self.cur.name, {})[id(t)] = self.nbytes(t)

    def part_bytes(self, name: str) -> int:
        return sum(self._saved.get(name, {}).values())

    def shared_bytes(self, first: str, second: str) -> int:
        """Bytes kept by both parts (a block's output kept by its ReLU and by the next block's conv)."""
        a, b = self._saved.get(first, {}), self._saved.get(second, {})
        return sum(size for key, size in a.items() if key in b)

    def total_bytes(self) -> int:
        unique: dict[int, int] = {}
        for saved in self._saved.values():
            unique.update(saved)
        return sum(unique.values())

    def params(self, count: int, trainable: bool = True) -> None:
        self.cur.params += count
        self.cur.param_bytes += FLOAT * count
        if trainable:
            self.cur.trainable += count

    def ch(self, global_channels: int, ratio: float | None = None) -> int:
        r = self.spec.width if ratio is None else ratio
        return kept_channels(global_channels, r, self.model.rounding)

    # -- ops (each applies what autograd saves for it) ----------------------------------------------
    def conv(
        self,
        x: Sym,
        cout: int,
        k: int,
        stride: int = 1,
        *,
        groups: int = 1,
        bias: bool = False,
        padding: int | None = None,
    ) -> Sym:
        cin, h, w = x.shape
        pad = k // 2 if padding is None else padding
        oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        self.params(cout * (cin // groups) * k * k + (cout if bias else 0))
        self.cur.macs += cout * oh * ow * (cin // groups) * k * k
        self.save(x)
        return self.new((cout, oh, ow))

    def bn(self, x: Sym, global_channels: int, ratio: float | None = None) -> Sym:
        c = x.shape[0]
        self.params(2 * c)
        stats = self.model.norm_stats
        if stats == "running":
            self.cur.param_bytes += 2 * FLOAT * c + INDEX
        elif stats == "per_width":
            top = self.spec.width if ratio is None else ratio
            for level in self.model.width_levels:
                if level <= top + 1e-9:
                    self.cur.param_bytes += (
                        2 * FLOAT * kept_channels(global_channels, level, self.model.rounding)
                    )
        self.save(x, self.new((c,), fixed=True), self.new((c,), fixed=True))  # input, mean, inverse std
        return self.new(x.shape)

    def relu(self, x: Sym) -> Sym:
        out = self.new(x.shape)
        self.save(out)
        return out

    def scaler(self, x: Sym) -> Sym:
        mode, width = self.model.scaler, self.spec.width
        active = width < 1.0 and mode in ("always", "train")  # the walk models training
        return self.new(x.shape) if active else x  # division by a constant saves nothing

    def step(self, x: Sym) -> Sym:
        learnable = self.model.learnable_step
        self.params(1, trainable=learnable)
        if learnable:
            self.save(x)
        return self.new(x.shape)

    def fresh(self, x: Sym) -> Sym:
        """Result of an op that keeps nothing (addition, padding, concatenation, up-sampling)."""
        return self.new(x.shape)

    def max_pool(self, x: Sym) -> Sym:
        c, h, w = x.shape
        out_shape = (c, (h - 1) // 2 + 1, (w - 1) // 2 + 1)
        self.save(x, self.new(out_shape, itemsize=INDEX))
        return self.new(out_shape)

    def pool(self, x: Sym) -> Sym:
        return self.new(x.shape[:1])

    def linear(self, x: Sym, out: int, *, bias: bool = True, saved: Sym | None = None) -> Sym:
        rows = math.prod(x.shape[:-1])
        self.params(out * x.shape[-1] + (out if bias else 0))
        self.cur.macs += rows * out * x.shape[-1]
        self.save(saved if saved is not None else x)
        return self.new((*x.shape[:-1], out))

    def layer_norm(self, x: Sym) -> Sym:
        tokens, dim = x.shape
        self.params(2 * dim)
        self.save(x, self.new((tokens,)), self.new((tokens,)))
        return self.new(x.shape)

    def loss(self, logits: Sym) -> None:
        """Cross-entropy keeps the log-probabilities, the int64 targets and a scalar weight."""
        if self._targets is None:
            self._targets = self.new((1,), itemsize=INDEX)  # one label tensor, shared by every output's loss
        self.save(self.new(logits.shape), self._targets, self.new((1,), fixed=True))

    # -- the model ------------------------------------------------------------------------------
    def run(self) -> None:
        """Walk the spec's model: its registered family drives the ops above (nestling/models/family.py)."""
        family_of(self.model.arch).walk(self)

    def kept(self, infos: tuple[BlockInfo, ...]) -> tuple[set[int], int]:
        """Executed blocks and depth of the spec (as the build keeps them)."""
        depth = len(infos) if self.spec.depth is None else self.spec.depth
        if depth > len(infos):
            raise SpecError(f"depth {depth} exceeds the {len(infos)} blocks of {self.model.arch}")
        kept = set(range(depth)) if self.spec.blocks is None else set(self.spec.blocks) & set(range(depth))
        return kept, depth

    def hidden(self, index: int) -> float | None:
        """Block `index`'s hidden-channel ratio, or None for the submodel's width."""
        return None if self.spec.block_widths is None else self.spec.block_widths[index]
