"""The expansion cost counted from the structure equals a measured training step (parameters, MACs, memory)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nestling.methods.dynamicfl.cost import (
    ExpansionCost,
    affordable_capacity,
    branch_cost,
    capacity_cost,
    expansion_cost,
    structure_cost,
)
from nestling.methods.dynamicfl.dbb import ORIGINAL, ConvGeometry, DiverseBranchBlock
from nestling.methods.dynamicfl.sites import expand_model, find_sites
from nestling.profiler.memory import SavedTensorMeter
from tests.methods.dynamicfl.reparam_helpers import resnet

GEOMETRIES = [
    (ConvGeometry(8, 16, 3, 1, 1, 1), None),
    (ConvGeometry(8, 8, 3, 1, 1, 2), 12),
    (ConvGeometry(8, 8, 5, 2, 2, 1), None),
    (ConvGeometry(8, 8, 3, 1, 1, 8), 16),
    (ConvGeometry(8, 16, 3, 2, 0, 1), None),
]


def _saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    meter = SavedTensorMeter(exclude=[*module.parameters(), *module.buffers(), x])
    with meter:
        module(x)
    return meter.total_bytes


def _macs(module: nn.Module, x: torch.Tensor) -> int:
    total = 0

    def hook(conv: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal total
        assert isinstance(conv, nn.Conv2d)
        total += (
            output[0].numel() * conv.in_channels // conv.groups * conv.kernel_size[0] * conv.kernel_size[1]
        )

    handles = [m.register_forward_hook(hook) for m in module.modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        module(x[:1])
    for handle in handles:
        handle.remove()
    return total


@pytest.mark.parametrize(("geometry", "inner"), GEOMETRIES)
def test_each_branch_costs_what_a_measured_step_shows(geometry: ConvGeometry, inner: int | None) -> None:
    plain = nn.Conv2d(
        geometry.in_channels,
        geometry.out_channels,
        geometry.kernel_size,
        geometry.stride,
        geometry.padding,
        groups=geometry.groups,
        bias=False,
    )
    for name in geometry.available_branches():
        block = DiverseBranchBlock(geometry, [name], inner_width=inner).train()
        measured = {}
        for batch in (1, 2):
            x = torch.randn(batch, geometry.in_channels, 9, 9, requires_grad=True)
            measured[batch] = _saved_bytes(block, x) - _saved_bytes(plain, x)
        per_sample = measured[2] - measured[1]
        counted = branch_cost(name, geometry, (9, 9), inner_width=inner)
        if name != ORIGINAL:
            counted = counted + branch_cost(ORIGINAL, geometry, (9, 9))
        x = torch.randn(1, geometry.in_channels, 9, 9)
        assert counted.activation_bytes == per_sample, name
        assert counted.fixed_activation_bytes == measured[1] - per_sample, name
        assert counted.params == sum(p.numel() for p in block.parameters()) - plain.weight.numel(), name
        assert counted.buffer_bytes == sum(b.numel() * b.element_size() for b in block.buffers()), name
        assert counted.forward_macs == _macs(block, x) - _macs(plain, x), name


def test_a_resnet_structure_costs_what_the_expanded_model_measures() -> None:
    net = resnet(dtype=torch.float32).train()
    sites = find_sites(net, (3, 32, 32))
    structure = {sites[0].name: None, sites[8].name: ("conv1x1", "identity")}

    def saved(batch: int) -> int:
        x = torch.randn(batch, 3, 32, 32)
        return _saved_bytes(net, x)

    plain = {b: saved(b) for b in (1, 2)}
    params = sum(p.numel() for p in net.parameters())
    expand_model(net, sites, structure)
    net.train()
    grown = {b: saved(b) for b in (1, 2)}
    counted = structure_cost(sites, structure)
    assert counted.activation_bytes == (grown[2] - plain[2]) - (grown[1] - plain[1])
    assert counted.fixed_activation_bytes == 2 * (grown[1] - plain[1]) - (grown[2] - plain[2])
    assert counted.params == sum(p.numel() for p in net.parameters()) - params


def test_capacity_prices_the_worst_choice_and_fits_a_budget() -> None:
    sites = find_sites(resnet(dtype=torch.float32), (3, 32, 32))
    costs = sorted((expansion_cost(s).training_bytes(32) for s in sites), reverse=True)
    assert capacity_cost(sites, 0, batch=32) == ExpansionCost()
    assert capacity_cost(sites, 2, batch=32).training_bytes(32) == costs[0] + costs[1]
    budget = costs[0] + costs[1] + costs[2] // 2
    assert affordable_capacity(sites, budget, batch=32) == 2
    assert affordable_capacity(sites, 0, batch=32) == 0
    assert affordable_capacity(sites, 10**12, batch=32, limit=3) == 3
    most_macs = max(expansion_cost(s).training_macs for s in sites)
    assert affordable_capacity(sites, 10**12, batch=32, spare_training_macs=most_macs) == 1
    one = capacity_cost(sites, 1, batch=32)
    assert one.training_bytes(32, momentum=True) - one.training_bytes(32) == 4 * one.params
