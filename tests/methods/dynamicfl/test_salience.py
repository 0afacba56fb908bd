"""Gradient salience S = Σ g·θ (METHODS §5.a.4, §5.b.7) and the top-c choice of convs to expand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nestling.methods.dynamicfl.dbb import ConvGeometry
from nestling.methods.dynamicfl.expansion import expand_conv
from nestling.methods.dynamicfl.salience import (
    SalienceMeter,
    bottom_up,
    branch_salience,
    salience,
    top_salient,
)
from nestling.methods.dynamicfl.sites import ConvSite, expand_model, find_sites
from tests.methods.dynamicfl.reparam_helpers import batches, resnet


def _sites(*names: str) -> list[ConvSite]:
    geometry = ConvGeometry(4, 4, 3, 1, 1)
    return [ConvSite(n, i, geometry, (8, 8), (8, 8), "bn", "bn_running_mean") for i, n in enumerate(names)]


def test_a_conv_without_gradient_has_zero_salience() -> None:
    conv = nn.Conv2d(4, 4, 3)
    assert salience(conv) == 0.0  # no backward yet: grad is None
    conv.weight.grad = torch.zeros_like(conv.weight)
    assert salience(conv) == 0.0


def test_salience_is_the_signed_sum_of_gradient_times_weight() -> None:
    conv = nn.Conv2d(2, 2, 1, bias=False)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([1.0, -2.0, 3.0, 0.5]).reshape(2, 2, 1, 1))
    conv.weight.grad = torch.tensor([2.0, 1.0, -1.0, 4.0]).reshape(2, 2, 1, 1)
    assert salience(conv) == pytest.approx(2.0 - 2.0 - 3.0 + 2.0)  # signed: -1, not Σ|g·θ|


def test_a_dbb_salience_sums_its_branch_convs() -> None:
    block = expand_conv(nn.Conv2d(4, 4, 3, 1, 1)).train()
    block(torch.randn(2, 4, 6, 6)).sum().backward()
    per_branch = branch_salience(block)
    assert per_branch["identity"] == 0.0  # no conv weight in the identity branch
    assert salience(block) == pytest.approx(sum(per_branch.values()))


def test_meter_averages_over_the_epoch_and_reads_frozen_convs_as_zero() -> None:
    net = resnet(dtype=torch.float32)
    sites = find_sites(net, (3, 32, 32))
    expand_model(net, sites, {sites[3].name: None})
    net.stem.conv.weight.requires_grad_(False)
    meter = SalienceMeter(net, sites)
    assert meter.means() == {}
    values = []
    net.train()
    for x in batches(2, dtype=torch.float32):
        net.zero_grad()
        F.cross_entropy(net(x), torch.zeros(len(x), dtype=torch.long)).backward()
        values.append(salience(net.get_submodule(sites[5].name)))
        meter.record()
    means = meter.means()
    assert means["stem.conv"] == 0.0
    assert means[sites[5].name] == pytest.approx(sum(values) / 2)
    assert set(meter.branch_means()) == {sites[3].name}


def test_top_c_ranks_by_signed_salience_and_breaks_ties_bottom_up() -> None:
    sites = _sites("a", "b", "c", "d")
    scores = {"a": -5.0, "b": 1.0, "c": 1.0, "d": 0.5}
    assert top_salient(scores, 2, sites) == ("b", "c")
    assert top_salient(scores, 1, sites) == ("b",)  # the tie between b and c goes to the lower conv
    assert top_salient(scores, 0, sites) == ()
    assert top_salient({"a": 1.0, "b": math.nan, "c": -3.0}, 2, sites) == ("a", "c")  # unmeasured rank last
    assert bottom_up(sites, 3) == ("a", "b", "c")
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        top_salient(scores, -1, sites)
