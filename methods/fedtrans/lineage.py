"""The family tree of grown models: parents, cell provenance, similarity and the tensor correspondence.

Models are numbered in creation order; model 0 is the seed model. Similarity (METHODS §4.a.5, AMBIG-13
DECISION): per cell of the larger model, the fraction of its parameters inherited from the smaller model,
composed along the lineage; sim = max(0, mean over the larger model's cells); sim(M, M) = 1; models on
different branches (neither an ancestor of the other) have sim 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nestling.errors import ConfigError
from nestling.methods.fedtrans.cells import (
    CellOrigin,
    Provenance,
    cell_of_key,
    cell_prefix,
    compose,
    identity_provenance,
    provenance_from_list,
    provenance_to_list,
)


@dataclass
class Lineage:
    """Parent and provenance (relative to the parent) of every model, plus each model's cell count."""

    parents: list[int | None] = field(default_factory=list)
    provenances: list[Provenance | None] = field(default_factory=list)
    cell_counts: list[int] = field(default_factory=list)

    @classmethod
    def seeded(cls, cells: int) -> Lineage:
        """The lineage of a family that holds only its seed model (of `cells` cells)."""
        return cls([None], [None], [cells])

    def add(self, parent: int, provenance: Provenance) -> int:
        """Record a model grown from `parent`; its index."""
        if not 0 <= parent < len(self.parents):
            raise ConfigError(f"parent model {parent} does not exist (models 0..{len(self.parents) - 1})")
        if any(o.parent_cell is not None and o.parent_cell >= self.cell_counts[parent] for o in provenance):
            raise ConfigError(f"the provenance names cells model {parent} does not have")
        self.parents.append(parent)
        self.provenances.append(tuple(provenance))
        self.cell_counts.append(len(provenance))
        return len(self.parents) - 1

    def ancestors(self, model: int) -> list[int]:
        """`model` and its ancestors, newest first."""
        chain = [model]
        while (parent := self.parents[chain[-1]]) is not None:
            chain.append(parent)
        return chain

    def correspondence(self, older: int, newer: int) -> Provenance | None:
        """Each cell of `newer` relative to `older` (an ancestor), or None when `older` is no ancestor."""
        chain = self.ancestors(newer)
        if older not in chain:
            return None
        composed = identity_provenance(self.cell_counts[older])
        for model in reversed(chain[: chain.index(older)]):
            step = self.provenances[model]
            assert step is not None
            composed = compose(composed, step)
        return composed

    def similarity(self, a: int, b: int) -> float:
        """sim(M_a, M_b), symmetric (METHODS §4.a.5 DECISION)."""
        if a == b:
            return 1.0
        older, newer = min(a, b), max(a, b)
        cells = self.correspondence(older, newer)
        if cells is None or not cells:
            return 0.0
        return max(0.0, sum(o.inherited_fraction for o in cells) / len(cells))

    def to_dict(self) -> dict[str, Any]:
        """JSON form for checkpoints."""
        return {
            "parents": list(self.parents),
            "provenances": [None if p is None else provenance_to_list(p) for p in self.provenances],
            "cell_counts": list(self.cell_counts),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Lineage:
        return cls(
            [None if p is None else int(p) for p in data["parents"]],
            [None if p is None else provenance_from_list(p) for p in data["provenances"]],
            [int(c) for c in data["cell_counts"]],
        )


def embed(
    source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], cells: Provenance
) -> dict[str, tuple[torch.Tensor, tuple[slice, ...]]]:
    """The older model's tensors placed onto the newer model's (METHODS §4.a.2 step 6, AMBIG-12 DECISION).

    Per key of `target`: the source tensor of the corresponding cell (stem and head keys map to themselves),
    cropped to the overlap and paired with the target slices it covers ("crop w_i to fit w_j", HeteroFL
    prefix overlap), a widened cell's consumer columns divided as Net2Wider divided them, so the placed
    tensors are the older model's function in the newer model's coordinates. Inserted cells, statistics counters and keys without a counterpart are left out.
    """
    placed: dict[str, tuple[torch.Tensor, tuple[slice, ...]]] = {}
    for key, tensor in target.items():
        if not tensor.is_floating_point():
            continue
        cell = cell_of_key(key)
        origin: CellOrigin | None = None if cell is None else cells[cell]
        if origin is None:
            source_key = key
        elif origin.parent_cell is None:
            continue
        else:
            source_key = f"{cell_prefix(origin.parent_cell)}{key.split('.', 2)[2]}"
        older = source.get(source_key)
        if older is None or older.dim() != tensor.dim():
            continue
        region = tuple(slice(0, min(a, b)) for a, b in zip(older.shape, tensor.shape))
        placed[key] = (_rescaled(older[region], origin, key, divide=True), region)
    return placed


def _rescaled(tensor: torch.Tensor, origin: CellOrigin | None, key: str, *, divide: bool) -> torch.Tensor:
    """`tensor` moved between an older cell's coordinates and a widened descendant's (Net2Wider's division).

    Widening divides the consumer's input column of each older unit by its replication count, so the older
    model's column u, placed on the descendant, is divided by the same `divisors[u]` (and a descendant's
    column placed back on the ancestor is multiplied by it). Without this a soft-aggregation step right after
    a birth would pull the child's divided columns back towards the undivided ones and change its function.
    """
    if origin is None or not origin.divisors or key.split(".", 2)[2] != origin.consumer:
        return tensor
    width = tensor.shape[1]
    divisors = torch.tensor(origin.divisors[:width], dtype=tensor.dtype)
    divisors = divisors.reshape(1, width, *([1] * (tensor.dim() - 2)))
    return tensor / divisors if divide else tensor * divisors


def embed_into_ancestor(
    source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], cells: Provenance
) -> dict[str, tuple[torch.Tensor, tuple[slice, ...]]]:
    """A newer model's tensors placed onto an ancestor's: the reverse of `embed`, for large-to-small sharing.

    `cells` is the newer model's provenance relative to the ancestor (`Lineage.correspondence(older, newer)`).
    Every cell of the newer model that has a parent cell gives that cell its tensors, cropped to the overlap
    (the same prefix rule, a widened cell's consumer columns multiplied back); inserted cells give nothing, and stem and head keys map to themselves. Each ancestor
    cell has at most one descendant cell (widen keeps cells one-to-one, deepen only adds cells).
    """
    placed: dict[str, tuple[torch.Tensor, tuple[slice, ...]]] = {}
    for key, newer in source.items():
        if not newer.is_floating_point():
            continue
        cell = cell_of_key(key)
        origin = None if cell is None else cells[cell]
        if origin is None:
            target_key = key
        else:
            if origin.parent_cell is None:
                continue
            target_key = f"{cell_prefix(origin.parent_cell)}{key.split('.', 2)[2]}"
        older = target.get(target_key)
        if older is None or not older.is_floating_point() or older.dim() != newer.dim():
            continue
        region = tuple(slice(0, min(a, b)) for a, b in zip(older.shape, newer.shape))
        placed[target_key] = (_rescaled(newer[region], origin, key, divide=False), region)
    return placed
