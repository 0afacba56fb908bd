"""DYMM plans (METHODS §5.a.5, AMBIG-15): DyRep's cut rule, combined salience, growth, collapse, shrink."""

from __future__ import annotations

import pytest
import torch

from nestling.methods.dynamicfl.dbb import ORIGINAL, ConvGeometry
from nestling.methods.dynamicfl.expansion import expand_conv
from nestling.methods.dynamicfl.modulation import (
    CutRule,
    ModulationPlan,
    apply_plan,
    combine_salience,
    current_structure,
    dymm_plan,
    released_plan,
    shrink_structure,
)
from nestling.methods.dynamicfl.sites import ConvSite, expand_model, find_sites
from tests.methods.dynamicfl.reparam_helpers import batches, randomise_norms, resnet

ALL = ("conv1x1", "conv1x1_kxk", "conv1x1_avg", ORIGINAL, "conv1xk", "convkx1", "identity")


def _sites(*names: str) -> list[ConvSite]:
    geometry = ConvGeometry(4, 4, 3, 1, 1)
    return [ConvSite(n, i, geometry, (8, 8), (8, 8), "bn", "bn_running_mean") for i, n in enumerate(names)]


def _with_gammas(gammas: dict[str, float]) -> torch.nn.Module:
    block = expand_conv(torch.nn.Conv2d(4, 4, 3, 1, 1))
    with torch.no_grad():
        for name, gamma in gammas.items():
            block.branch(name).last_bn.weight.fill_(gamma)
    return block


def test_cut_rule_needs_spread_and_cuts_weak_branches_below_the_mean() -> None:
    rule = CutRule()
    fresh = _with_gammas({})
    assert rule.redundant(fresh) == ()  # every new branch at 0.01: no spread
    block = _with_gammas(
        {
            ORIGINAL: 2.0,
            "conv1x1": 0.1,
            "conv1x1_kxk": 0.4,
            "conv1x1_avg": 0.02,
            "conv1xk": 0.3,
            "convkx1": 0.18,
            "identity": 0.5,
        }
    )
    weights = rule.branch_weights(block)
    assert weights["conv1x1"] == pytest.approx(0.05) and weights["identity"] == pytest.approx(0.25)
    assert rule.redundant(block) == ("conv1x1", "conv1x1_avg", "convkx1")  # w < mean and w < 0.1


def test_combined_salience_is_the_even_mix_and_one_sided_sites_keep_their_value() -> None:
    assert combine_salience({"a": 2.0, "b": 1.0}, {"a": 4.0, "c": -1.0}) == {"a": 3.0, "b": 1.0, "c": -1.0}
    assert combine_salience({"a": 2.0}, {"a": 4.0}, local_weight=1.0) == {"a": 2.0}
    with pytest.raises(ValueError, match="local_weight"):
        combine_salience({}, {}, local_weight=1.5)


def test_dymm_grows_the_most_salient_collapses_the_rest_and_cuts_marked_branches() -> None:
    sites = _sites("a", "b", "c", "d")
    structure = {"a": ALL, "b": ALL, "c": (ORIGINAL, "conv1x1")}
    plan = dymm_plan(
        structure,
        {"a": 1.0, "b": 3.0, "c": 2.0, "d": 5.0},
        3,
        sites,
        redundant={"b": ("conv1x1", "identity"), "c": ("conv1x1",)},
    )
    # top-3 = d, b, c; a drops out; c loses its only extra branch and collapses; d grows.
    assert plan == ModulationPlan(grow=("d",), cut={"b": ("conv1x1", "identity")}, collapse=("a", "c"))
    assert dymm_plan({}, {}, 0, sites).empty
    with pytest.raises(ValueError, match="not sites of this model: \\['z'\\]"):
        dymm_plan({"z": ALL}, {}, 1, sites)


def test_released_plan_and_budget_shrink() -> None:
    sites = _sites("a", "b", "c")
    assert released_plan({"a": 0.1, "b": 0.3, "c": 0.2}, 2, sites).grow == ("b", "c")
    shrunk = shrink_structure(
        {"a": ALL, "b": (ORIGINAL, "identity")}, {"a": 0.1, "b": 0.3, "c": 0.2}, 1, sites
    )
    assert shrunk == {"b": (ORIGINAL, "identity")}
    assert shrink_structure({"a": ALL}, {"c": 1.0}, 1, sites) == {"c": None}


def test_applying_a_plan_keeps_the_function() -> None:
    net = resnet()
    sites = find_sites(net, (3, 32, 32))
    names = [s.name for s in sites]
    expand_model(net, sites, {names[1]: None, names[4]: None}, batches=batches(2))
    randomise_norms(net.get_submodule(names[1]), torch.Generator().manual_seed(1))
    randomise_norms(net.get_submodule(names[4]), torch.Generator().manual_seed(2))
    x = batches(1, seed=9)[0]
    with torch.no_grad():
        before = net(x)
    plan = ModulationPlan(grow=(names[10],), cut={names[1]: ("conv1x1", "convkx1")}, collapse=(names[4],))
    apply_plan(net, sites, plan, batches=batches(2), generator=torch.Generator().manual_seed(0))
    structure = current_structure(net)
    assert set(structure) == {names[1], names[10]}
    assert "conv1x1" not in structure[names[1]] and len(structure[names[10]]) == 7
    with torch.no_grad():
        assert (net(x) - before).abs().max() <= 1e-10
