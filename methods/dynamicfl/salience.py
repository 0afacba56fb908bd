"""Gradient salience of each conv site and the top-c choice of which convs a board expands (METHODS §5.a.4–5).

Salience is DyRep's "synflow" score as DynamicFL's code uses it: S = Σ_j g_j·θ_j, the *signed* sum of
gradient × weight over a conv's weights, averaged over the backward passes of one local epoch. For a
conv that is already a DBB, S sums over the conv weights of all its branches (the first-order change of
the loss if the whole block were removed); each branch's own sum is kept too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from nestling.methods.dynamicfl.dbb import DiverseBranchBlock
from nestling.methods.dynamicfl.sites import ConvSite


def _gradient_weight_sum(weights: list[torch.Tensor]) -> float:
    total = 0.0
    for weight in weights:
        if weight.grad is not None:
            total += float((weight.grad.double() * weight.detach().double()).sum())
    return total


def conv_weights(module: nn.Module) -> list[torch.Tensor]:
    """The conv kernels salience is measured on: the conv's own, or every branch conv of a DBB."""
    if isinstance(module, DiverseBranchBlock):
        return [m.weight for m in module.modules() if isinstance(m, nn.Conv2d)]
    if isinstance(module, nn.Conv2d):
        return [module.weight]
    raise TypeError(f"salience is measured on convs and DBBs, not on a {type(module).__name__}")


def salience(module: nn.Module) -> float:
    """S = Σ g·θ over the module's conv weights, from the gradients it holds now (no gradient: 0)."""
    return _gradient_weight_sum(conv_weights(module))


def branch_salience(dbb: DiverseBranchBlock) -> dict[str, float]:
    """Each branch's own Σ g·θ over its conv weights (the identity branch has none: 0)."""
    return {
        name: _gradient_weight_sum([m.weight for m in branch.modules() if isinstance(m, nn.Conv2d)])
        for name, branch in dbb.branches.items()
    }


class SalienceMeter:
    """Averages each site's salience over the backward passes of one epoch: call `record()` after each backward.

    The model may change structure between epochs (a new meter per epoch), not within one.
    """

    def __init__(self, model: nn.Module, sites: Sequence[ConvSite]) -> None:
        self.model = model
        self.names = [site.name for site in sites]
        self.iterations = 0
        self._sums = dict.fromkeys(self.names, 0.0)
        self._branch_sums: dict[str, dict[str, float]] = {}

    def record(self) -> None:
        for name in self.names:
            module = self.model.get_submodule(name)
            self._sums[name] += salience(module)
            if isinstance(module, DiverseBranchBlock):
                sums = self._branch_sums.setdefault(name, {})
                for branch, value in branch_salience(module).items():
                    sums[branch] = sums.get(branch, 0.0) + value
        self.iterations += 1

    def means(self) -> dict[str, float]:
        """Mean salience per site over the recorded iterations (empty before the first record)."""
        if self.iterations == 0:
            return {}
        return {name: total / self.iterations for name, total in self._sums.items()}

    def branch_means(self) -> dict[str, dict[str, float]]:
        """Mean salience per branch of every site that was a DBB while recording."""
        if self.iterations == 0:
            return {}
        return {
            name: {b: v / self.iterations for b, v in sums.items()}
            for name, sums in self._branch_sums.items()
        }


def _score(values: Mapping[str, float], name: str) -> float:
    value = values.get(name)
    return -math.inf if value is None or math.isnan(value) else float(value)


def top_salient(
    salience_by_site: Mapping[str, float], capacity: int, sites: Sequence[ConvSite]
) -> tuple[str, ...]:
    """The `capacity` sites with the highest signed salience, in forward order.

    Ties go to the site nearer the input (the paper's "bottom to top"); sites without a measured
    salience rank last.
    """
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    ranked = sorted(sites, key=lambda site: (-_score(salience_by_site, site.name), site.order))
    chosen = ranked[:capacity]
    return tuple(site.name for site in sorted(chosen, key=lambda site: site.order))


def bottom_up(sites: Sequence[ConvSite], capacity: int) -> tuple[str, ...]:
    """The first `capacity` sites from the input up: the paper's round-0 expansion, before any salience exists."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    return tuple(site.name for site in sorted(sites, key=lambda site: site.order)[:capacity])
