"""Dynamic model modulation: which convs grow into DBBs, which branches are cut (METHODS §5.a.5, AMBIG-15).

Two protocols decide a board's structure:
* released code (stateless): grow the top-c convs by the salience of local epoch 0; no cuts;
* paper (stateful) DYMM: S = 0.5·S^l + 0.5·S^g; branches that DyRep's rule finds redundant are fused
  into the K×K branch; the capacity's c slots go to the c most salient convs (a DBB that drops out of
  them is fused back to its plain conv, a plain conv that enters grows a full DBB). A board whose budget
  shrank below last round's structure re-chooses from S^l alone.
A plan is data (`ModulationPlan`); `apply_plan` carries it out on a model, always function-preserving.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nestling.methods.dynamicfl.dbb import ORIGINAL, DiverseBranchBlock
from nestling.methods.dynamicfl.expansion import RECALIBRATION_ITERATIONS, cut_branches
from nestling.methods.dynamicfl.salience import top_salient
from nestling.methods.dynamicfl.sites import ConvSite, expand_model, expanded_blocks, fuse_block

LOCAL_WEIGHT = 0.5  # DECISION (AMBIG-15): the code's unused alpha = beta = 0.5


@dataclass(frozen=True)
class CutRule:
    """DyRep's rule for redundant branches (METHODS §5.a.5).

    Branch weight w_b = mean|γ of branch b's last BN| / mean|γ of the K×K branch's BN|. When the sample
    standard deviation of the non-K×K weights exceeds `spread`, every branch with w_b below both their
    mean and `floor` is redundant. Fewer than two non-K×K branches: nothing is cut.
    """

    spread: float = 0.02
    floor: float = 0.1

    def branch_weights(self, dbb: DiverseBranchBlock) -> dict[str, float]:
        reference = float(dbb.original.bn.weight.detach().abs().mean())
        if reference == 0.0:
            reference = 1e-12
        return {
            name: float(dbb.branch(name).last_bn.weight.detach().abs().mean()) / reference
            for name in dbb.branch_names
            if name != ORIGINAL
        }

    def redundant(self, dbb: DiverseBranchBlock) -> tuple[str, ...]:
        weights = self.branch_weights(dbb)
        if len(weights) < 2:
            return ()
        values = torch.tensor(list(weights.values()), dtype=torch.float64)
        if float(values.std()) <= self.spread:
            return ()
        mean = float(values.mean())
        return tuple(name for name, w in weights.items() if w < mean and w < self.floor)


def combine_salience(
    local: Mapping[str, float], global_: Mapping[str, float], local_weight: float = LOCAL_WEIGHT
) -> dict[str, float]:
    """S = w·S^l + (1 − w)·S^g per site; a site measured in only one of them takes that value."""
    if not 0.0 <= local_weight <= 1.0:
        raise ValueError(f"local_weight must be in [0, 1], got {local_weight}")
    combined: dict[str, float] = {}
    for name in sorted(set(local) | set(global_)):
        if name in local and name in global_:
            combined[name] = local_weight * local[name] + (1.0 - local_weight) * global_[name]
        else:
            combined[name] = local[name] if name in local else global_[name]
    return combined


@dataclass(frozen=True)
class ModulationPlan:
    """What to change in a model's structure: grow plain convs, cut branches, collapse DBBs back to convs."""

    grow: tuple[str, ...] = ()
    cut: dict[str, tuple[str, ...]] = field(default_factory=dict)
    collapse: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.grow or self.cut or self.collapse)

    def to_dict(self) -> dict[str, Any]:
        return {
            "grow": list(self.grow),
            "cut": {k: list(v) for k, v in self.cut.items()},
            "collapse": list(self.collapse),
        }


def released_plan(
    salience_by_site: Mapping[str, float], capacity: int, sites: Sequence[ConvSite]
) -> ModulationPlan:
    """The released code: grow the top-c convs by epoch-0 salience (METHODS §5.a.5 last-but-one bullet)."""
    return ModulationPlan(grow=top_salient(salience_by_site, capacity, sites))


def dymm_plan(
    structure: Mapping[str, Sequence[str]],
    salience_by_site: Mapping[str, float],
    capacity: int,
    sites: Sequence[ConvSite],
    redundant: Mapping[str, Sequence[str]] | None = None,
) -> ModulationPlan:
    """The paper's DYMM as a plan (DECISION, AMBIG-15).

    `structure`: the DBBs the model has now (site → branches); `salience_by_site`: the combined S;
    `redundant`: branches the cut rule marked, per DBB. A DBB left with only its K×K branch after the cut
    is collapsed, as is any DBB outside the c most salient sites; those sites that are still plain grow.
    """
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    known = {site.name for site in sites}
    strangers = sorted(set(structure) - known)
    if strangers:
        raise ValueError(f"structure names convs that are not sites of this model: {strangers}")
    target = set(top_salient(salience_by_site, capacity, sites))
    cut: dict[str, tuple[str, ...]] = {}
    collapse: list[str] = []
    for name, branches in structure.items():
        marked = tuple(b for b in (redundant or {}).get(name, ()) if b != ORIGINAL and b in branches)
        left = [b for b in branches if b != ORIGINAL and b not in marked]
        if name not in target or not left:
            collapse.append(name)
        elif marked:
            cut[name] = marked
    order = {site.name: site.order for site in sites}
    grow = tuple(sorted((name for name in target if name not in structure), key=order.__getitem__))
    return ModulationPlan(grow=grow, cut=cut, collapse=tuple(sorted(collapse, key=order.__getitem__)))


def shrink_structure(
    structure: Mapping[str, Sequence[str]],
    local: Mapping[str, float],
    capacity: int,
    sites: Sequence[ConvSite],
) -> dict[str, tuple[str, ...] | None]:
    """A board that cannot afford last round's structure re-chooses c convs from S^l only (METHODS §5.a.5).

    Convs it keeps keep their branch sets; newly chosen ones get every available branch (None).
    """
    return {
        name: (tuple(structure[name]) if name in structure else None)
        for name in top_salient(local, capacity, sites)
    }


def current_structure(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Site name → branches of every DBB in the model (the structure ζ_i)."""
    return {name: dbb.branch_names for name, dbb in expanded_blocks(model).items()}


def apply_plan(
    model: nn.Module,
    sites: Sequence[ConvSite],
    plan: ModulationPlan,
    *,
    batches: Iterable[torch.Tensor] | None = None,
    iterations: int = RECALIBRATION_ITERATIONS,
    generator: torch.Generator | None = None,
    inner_width: int | None = None,
) -> None:
    """Carry out `plan` on `model` (eval-mode function unchanged): cuts, then collapses, then growth."""
    blocks = expanded_blocks(model)
    for name, branches in plan.cut.items():
        if name not in blocks:
            raise ValueError(f"cannot cut branches of '{name}': it is not a DBB in this model")
        cut_branches(blocks[name], branches)
    for name in plan.collapse:
        fuse_block(model, name)
    if plan.grow:
        expand_model(
            model,
            sites,
            dict.fromkeys(plan.grow),
            batches=batches,
            iterations=iterations,
            generator=generator,
            inner_width=inner_width,
        )
