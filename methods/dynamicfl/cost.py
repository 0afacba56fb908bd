"""What expanding convs into DBBs adds to a training step: parameters, buffers, MACs, saved activations.

Counted from the branch structure, op by op, with the rule autograd follows for each op (the profiler's
rule, profiler/trace.py): a conv keeps its input, a BN its input and two per-channel statistics, average
pooling its input, BN-and-pad in train mode the batch statistics it pads with (3 per-channel vectors) and
its border mask, a sum nothing. The block's input is kept by the plain conv already, so branches reading it
add nothing for it; the block's output replaces the conv's output one for one. Figures are the extra over
the plain conv and match a measured step exactly (tests/methods/dynamicfl/test_cost.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from nestling.methods.dynamicfl.dbb import ORIGINAL, ConvGeometry, checked_branches
from nestling.methods.dynamicfl.sites import ConvSite

FLOAT = 4
INDEX = 8  # a BN's num_batches_tracked


@dataclass(frozen=True)
class ExpansionCost:
    """Extra over the plain model: per-sample figures scale with the batch, fixed ones do not."""

    params: int = 0
    buffer_bytes: int = 0
    forward_macs: int = 0  # per sample
    activation_bytes: int = 0  # saved for backward, per sample
    fixed_activation_bytes: int = 0  # saved for backward, independent of the batch size

    def __add__(self, other: ExpansionCost) -> ExpansionCost:
        return ExpansionCost(
            self.params + other.params,
            self.buffer_bytes + other.buffer_bytes,
            self.forward_macs + other.forward_macs,
            self.activation_bytes + other.activation_bytes,
            self.fixed_activation_bytes + other.fixed_activation_bytes,
        )

    @property
    def training_macs(self) -> int:
        """Forward + backward ≈ 3× forward, the profiler's convention."""
        return 3 * self.forward_macs

    def training_bytes(self, batch: int, *, momentum: bool = False) -> int:
        """Extra peak training memory at `batch`: parameters, their gradients (and momentum), buffers, activations."""
        copies = 3 if momentum else 2
        return (
            copies * FLOAT * self.params
            + self.buffer_bytes
            + batch * self.activation_bytes
            + self.fixed_activation_bytes
        )


def _bn(channels: int, saved_input: int, itemsize: int) -> ExpansionCost:
    """A BN over `channels` whose input (saved_input elements per sample, 0 if already kept) is new."""
    return ExpansionCost(
        params=2 * channels,
        buffer_bytes=2 * itemsize * channels + INDEX,
        activation_bytes=itemsize * saved_input,
        fixed_activation_bytes=2 * itemsize * channels,
    )


def _border(channels: int, padded: tuple[int, int], itemsize: int) -> ExpansionCost:
    """BN-and-pad in train mode: batch mean, σ and the scale it pads with, plus a bool mask of the padded map."""
    return ExpansionCost(fixed_activation_bytes=3 * itemsize * channels + padded[0] * padded[1])


def branch_cost(
    name: str,
    geometry: ConvGeometry,
    input_size: tuple[int, int],
    *,
    inner_width: int | None = None,
    itemsize: int = FLOAT,
) -> ExpansionCost:
    """One branch's cost as it runs inside a DBB (for the K×K branch: only its bias and BN over the plain conv)."""
    g = geometry
    c_in, c_out, k, groups = g.in_channels, g.out_channels, g.kernel_size, g.groups
    h, w = input_size
    ho, wo = g.output_size(h, w)
    out = c_out * ho * wo
    per_group = c_in // groups
    if name == ORIGINAL:
        return ExpansionCost(params=c_out) + _bn(c_out, out, itemsize)
    if name == "conv1x1":
        return ExpansionCost(params=c_out * per_group, forward_macs=out * per_group) + _bn(
            c_out, out, itemsize
        )
    if name in ("conv1xk", "convkx1"):
        return ExpansionCost(params=c_out * per_group * k, forward_macs=out * per_group * k) + _bn(
            c_out, out, itemsize
        )
    if name == "identity":
        return _bn(c_out, 0, itemsize)
    p = g.padding
    padded = (h + 2 * p, w + 2 * p)
    if name == "conv1x1_avg" and g.direct_average:
        return _bn(c_out, out, itemsize)  # the pool keeps the block's input, already kept
    inner = c_out if name == "conv1x1_avg" else (c_in if inner_width is None else inner_width)
    first = ExpansionCost(params=inner * per_group, forward_macs=inner * h * w * per_group)
    cost = first + _bn(inner, inner * h * w, itemsize)
    if p:
        cost = cost + _border(inner, padded, itemsize)
    # The (padded) BN output is kept by the K×K conv or the pool that reads it.
    cost = cost + ExpansionCost(activation_bytes=itemsize * inner * padded[0] * padded[1])
    if name == "conv1x1_kxk":
        cost = cost + ExpansionCost(
            params=c_out * (inner // groups) * k * k, forward_macs=out * (inner // groups) * k * k
        )
    elif name != "conv1x1_avg":
        raise ValueError(f"unknown DBB branch '{name}'")
    return cost + _bn(c_out, out, itemsize)


def expansion_cost(
    site: ConvSite,
    branches: Iterable[str] | None = None,
    *,
    inner_width: int | None = None,
    itemsize: int = FLOAT,
) -> ExpansionCost:
    """Extra cost of training `site` as a DBB with `branches` (None: every available one) instead of a plain conv."""
    total = ExpansionCost()
    for name in checked_branches(site.geometry, branches):
        total = total + branch_cost(
            name, site.geometry, site.input_size, inner_width=inner_width, itemsize=itemsize
        )
    return total


def structure_cost(
    sites: Sequence[ConvSite],
    structure: Mapping[str, Iterable[str] | None],
    *,
    inner_width: int | None = None,
) -> ExpansionCost:
    """Extra cost of a whole structure ζ (site → branches)."""
    by_name = {site.name: site for site in sites}
    unknown = sorted(set(structure) - set(by_name))
    if unknown:
        raise ValueError(f"not sites of this model: {unknown}")
    total = ExpansionCost()
    for name, branches in structure.items():
        total = total + expansion_cost(by_name[name], branches, inner_width=inner_width)
    return total


def _worst(
    costs: list[ExpansionCost], capacity: int, key: Callable[[ExpansionCost], tuple[int, ...]]
) -> ExpansionCost:
    total = ExpansionCost()
    for cost in sorted(costs, key=key, reverse=True)[:capacity]:
        total = total + cost
    return total


def capacity_cost(
    sites: Sequence[ConvSite],
    capacity: int,
    *,
    batch: int,
    momentum: bool = False,
    inner_width: int | None = None,
) -> ExpansionCost:
    """The most memory a capacity of c expanded convs can take: the c sites whose full DBBs need the most.

    Salience picks the convs at run time, so a board is priced for the worst choice and never gets a
    structure that does not fit.
    """
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    costs = [expansion_cost(site, inner_width=inner_width) for site in sites]
    return _worst(costs, capacity, lambda c: (c.training_bytes(batch, momentum=momentum), c.training_macs))


def affordable_capacity(
    sites: Sequence[ConvSite],
    spare_bytes: int,
    *,
    batch: int,
    momentum: bool = False,
    spare_training_macs: int | None = None,
    inner_width: int | None = None,
    limit: int | None = None,
) -> int:
    """The largest c whose worst choice of c convs fits the spare memory and, if given, the spare MACs per sample."""
    costs = [expansion_cost(site, inner_width=inner_width) for site in sites]
    best = 0
    top = len(sites) if limit is None else min(limit, len(sites))
    for capacity in range(1, top + 1):
        memory = _worst(
            costs, capacity, lambda c: (c.training_bytes(batch, momentum=momentum), c.training_macs)
        )
        if memory.training_bytes(batch, momentum=momentum) > spare_bytes:
            break
        if spare_training_macs is not None:
            compute = _worst(costs, capacity, lambda c: (c.training_macs,))
            if compute.training_macs > spare_training_macs:
                break
        best = capacity
    return best
