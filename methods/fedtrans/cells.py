"""Cells of a growable model (METHODS §4.a.1): the residual blocks of a family that has a layout.

A cell is the unit FedTrans widens or deepens: one block `blocks.{i}`. Its growable width and the block count
per stage are carried by `extra["layout"]` (nestling.models.config.validated_layout); which tensors a
transformation touches is the family's answer to `growth_cells` (nestling.models.family.GrowthCells):
* the ResNet families (CIFAR ResNets, PreResNet, ResNet-18/34, the tiny CNN, whose conv layers are one
  BasicBlock per stage): a residual block, grown in its internal width (conv1's outputs);
* the ViT: an encoder block, grown in its MLP hidden width (fc1's outputs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nestling.errors import ConfigError
from nestling.models.config import ModelConfig
from nestling.models.family import GrowthCells, ModelFamily, family_of
from nestling.models.layers import is_running_statistic

State = dict[str, torch.Tensor]
CELL_KINDS = ("inherited", "widened", "inserted")


@dataclass(frozen=True)
class Layout:
    """Blocks per stage and every block's internal width (channels), in depth order."""

    stage_blocks: tuple[int, ...]
    block_hidden: tuple[int, ...]

    def stage_of(self, cell: int) -> tuple[int, int]:
        """(stage, position inside the stage) of global block `cell`."""
        offset = 0
        for stage, count in enumerate(self.stage_blocks):
            if cell < offset + count:
                return stage, cell - offset
            offset += count
        raise ConfigError(f"cell {cell} does not exist (the model has {offset} blocks)")

    def stage_start(self, stage: int) -> int:
        return sum(self.stage_blocks[:stage])


@dataclass(frozen=True)
class CellOrigin:
    """Where one cell of a model came from in an older model (METHODS §4.a.5).

    kind: inherited (same tensors), widened (a prefix of its units are the older cell's) or inserted (new);
    `inherited_fraction` = #params of the older cell / #params of this cell (1, <1, 0), the cell's mc(l).
    A widened cell also records how Net2Wider rescaled the older units: `consumer` (the block-relative name
    of the weight whose input columns are the units) and `divisors`, per unit of the older cell, what its
    column was divided by (the replication count, multiplied along the lineage). Soft aggregation needs them
    to express the older weights in this cell's coordinates (`lineage.embed`); empty when nothing was divided.
    """

    kind: str
    parent_cell: int | None
    inherited_fraction: float
    consumer: str = ""
    divisors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in CELL_KINDS:
            raise ConfigError(f"cell kind must be one of {CELL_KINDS}, got {self.kind!r}")
        if (self.kind == "inserted") != (self.parent_cell is None):
            raise ConfigError("an inserted cell has no parent cell and every other cell has one")
        if bool(self.consumer) != bool(self.divisors) or any(not d >= 1.0 for d in self.divisors):
            raise ConfigError("a widened cell's divisors need their consumer weight, and each is >= 1")


Provenance = tuple[CellOrigin, ...]  # one CellOrigin per cell of the newer model


def growable_family(config: ModelConfig) -> ModelFamily:
    """The family of `config`, refused clearly when FedTrans cannot grow it."""
    family = family_of(config.arch)
    if not family.supports_layout or family.growth_cells(config.extra) is None:
        raise ConfigError(
            f"[model] FedTrans grows the ResNet families and the ViT (cells = residual or encoder blocks); "
            f"model family '{config.arch}' has no growable blocks"
        )
    if config.exit_points:
        raise ConfigError("[model] FedTrans grows single-head models; exit_points must be empty")
    if config.norm_stats == "per_width":
        raise ConfigError("[model] FedTrans cannot grow per-width BN statistics (norm_stats 'per_width')")
    return family


def growth_cells(config: ModelConfig) -> GrowthCells:
    """The tensors a transformation of `config`'s blocks touches (its family's answer)."""
    cells = growable_family(config).growth_cells(config.extra)
    assert cells is not None  # growable_family refused families without them
    return cells


def layout_of(config: ModelConfig) -> Layout:
    """The explicit layout of `config` (the family's own depths and stage widths when it has none)."""
    family = growable_family(config)
    return Layout(
        tuple(family.stage_depths(config.extra)), tuple(family.block_hidden(config.image_size, config.extra))
    )


def with_layout(config: ModelConfig, layout: Layout) -> ModelConfig:
    """`config` describing `layout` (the board builds it from the task's ModelConfig)."""
    layout_table = {"stage_blocks": list(layout.stage_blocks), "block_hidden": list(layout.block_hidden)}
    return config.with_(extra={**config.extra, "layout": layout_table})


def cell_prefix(cell: int) -> str:
    return f"blocks.{cell}."


def cell_of_key(key: str) -> int | None:
    """The cell a state key belongs to, or None for the stem and the head (shared by every model)."""
    if not key.startswith("blocks."):
        return None
    return int(key.split(".", 2)[1])


def is_statistic(key: str) -> bool:
    """BN running statistics and counters: state, not trained weights."""
    return is_running_statistic(key)


def cell_parameter_count(state: Mapping[str, torch.Tensor], cell: int) -> int:
    """Trained parameters of one cell (BN statistics excluded), the #param of METHODS §4.a.5."""
    prefix = cell_prefix(cell)
    return sum(t.numel() for k, t in state.items() if k.startswith(prefix) and not is_statistic(k))


def cell_count(config: ModelConfig) -> int:
    return sum(layout_of(config).stage_blocks)


def identity_provenance(count: int) -> Provenance:
    """Every cell inherited unchanged from the same position (a model relative to itself)."""
    return tuple(CellOrigin("inherited", cell, 1.0) for cell in range(count))


def compose(older: Provenance, newer: Provenance) -> Provenance:
    """Provenance of C relative to A, from B relative to A (`older`) and C relative to B (`newer`)."""
    composed: list[CellOrigin] = []
    for origin in newer:
        if origin.parent_cell is None:
            composed.append(origin)
            continue
        before = older[origin.parent_cell]
        if before.parent_cell is None:
            composed.append(CellOrigin("inserted", None, 0.0))
            continue
        fraction = before.inherited_fraction * origin.inherited_fraction
        kind = "inherited" if before.kind == origin.kind == "inherited" else "widened"
        consumer, divisors = _composed_divisors(before, origin)
        composed.append(CellOrigin(kind, before.parent_cell, fraction, consumer, divisors))
    return tuple(composed)


def _composed_divisors(before: CellOrigin, after: CellOrigin) -> tuple[str, tuple[float, ...]]:
    """Divisors of A's units in C: A's unit u is unit u of B (the prefix), itself unit u of C."""
    if not after.divisors:
        return before.consumer, before.divisors
    if not before.divisors:
        return after.consumer, after.divisors
    return before.consumer, tuple(d * after.divisors[u] for u, d in enumerate(before.divisors))


def provenance_to_list(provenance: Provenance) -> list[list[object]]:
    """JSON form for checkpoints: [kind, parent_cell, inherited_fraction(, consumer, divisors)] per cell."""
    rows: list[list[object]] = []
    for o in provenance:
        row: list[object] = [o.kind, o.parent_cell, o.inherited_fraction]
        if o.divisors:
            row += [o.consumer, list(o.divisors)]
        rows.append(row)
    return rows


def provenance_from_list(rows: list[list[Any]]) -> Provenance:
    """Checkpoints written before divisors were recorded read as cells with nothing divided."""
    origins = []
    for row in rows:
        if len(row) not in (3, 5):
            raise ConfigError(f"a provenance row has 3 or 5 entries, got {row!r}")
        kind, parent, fraction = row[:3]
        consumer, divisors = (str(row[3]), tuple(float(d) for d in row[4])) if len(row) == 5 else ("", ())
        origins.append(
            CellOrigin(
                str(kind), None if parent is None else int(parent), float(fraction), consumer, divisors
            )
        )
    return tuple(origins)


def model_macs(config: ModelConfig) -> int:
    """MACs of one forward pass of the model `config` describes (compared with client capacities T_c)."""
    from nestling.models.cost import count_macs
    from nestling.models.zoo import build  # the zoo imports every family module: import on use
    from nestling.spec import SubmodelSpec

    with torch.random.fork_rng(devices=[]):  # building draws initial weights: keep the caller's RNG stream
        net = build(SubmodelSpec(config), init=False)
    return count_macs(net, (config.in_channels, config.image_size, config.image_size))
