"""Sites of zoo models, expansion in place and fusion back to the exact plain model (METHODS §5.b.5–6, §5.b.8)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from nestling.methods.dynamicfl.dbb import ConvGeometry, DiverseBranchBlock
from nestling.methods.dynamicfl.sites import (
    ConvSite,
    branch_state,
    expand_model,
    expanded_blocks,
    find_sites,
    fuse_block,
    fuse_model,
)
from nestling.models.layers import SlimConv2d
from tests.methods.dynamicfl.reparam_helpers import batches, randomise_norms, resnet


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_resnet20_sites_are_every_3x3_conv_with_its_bn_in_forward_order() -> None:
    net = resnet()
    before = _snapshot(net)
    sites = find_sites(net, (3, 32, 32))
    assert [s.name for s in sites][:4] == ["stem.conv", "blocks.0.conv1", "blocks.0.conv2", "blocks.1.conv1"]
    assert len(sites) == 19  # the stem and both convs of 9 blocks; 1×1 projections are not K×K
    assert all(s.sink_kind == "bn_running_mean" for s in sites)
    assert sites[1].bias_sink == "blocks.0.bn1" and sites[-1].bias_sink == "blocks.8.bn2"
    assert [s.order for s in sites] == list(range(19))
    strided = next(s for s in sites if s.name == "blocks.3.conv1")
    assert strided.geometry == ConvGeometry(16, 32, 3, 2, 1, 1)
    assert strided.input_size == (32, 32) and strided.output_size == (16, 16)
    after = _snapshot(net)
    assert all(torch.equal(before[k], after[k]) for k in before), "the probe pass must not touch the model"


def test_preact_conv2_feeds_a_residual_sum_so_it_is_not_a_site() -> None:
    sites = find_sites(resnet("preresnet20"), (3, 32, 32))
    names = [s.name for s in sites]
    assert "blocks.0.conv1" in names and not any(n.endswith("conv2") for n in names)
    assert next(s for s in sites if s.name == "blocks.0.conv1").bias_sink == "blocks.0.bn2"


class _Shapes(nn.Module):
    """Convs in every situation the sole-consumer rule must tell apart."""

    def __init__(self) -> None:
        super().__init__()
        self.relu_between = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn_a = nn.BatchNorm2d(4)
        self.shared = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn_b = nn.BatchNorm2d(4)
        self.batch_stats = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn_c = nn.BatchNorm2d(4, track_running_stats=False)
        self.own_bias = nn.Conv2d(4, 4, 3, padding=1, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn_a(torch.relu(self.relu_between(x)))
        y = self.shared(x)
        x = self.bn_b(y) + y  # the conv's output has a second consumer
        x = self.bn_c(self.batch_stats(x))
        return self.own_bias(x)


def test_only_convs_whose_bias_has_an_exact_home_are_sites() -> None:
    sites = {s.name: s for s in find_sites(_Shapes(), (3, 8, 8))}
    assert set(sites) == {"batch_stats", "own_bias"}
    assert sites["batch_stats"].sink_kind == "bn_batch_stats"
    assert sites["own_bias"].sink_kind == "conv_bias" and sites["own_bias"].bias_sink == ""


def test_bias_folding_is_exact_for_every_sink_kind() -> None:
    torch.manual_seed(0)
    net = _Shapes().double().eval()
    randomise_norms(net, torch.Generator().manual_seed(1))
    sites = find_sites(net, (3, 8, 8))
    expand_model(net, sites, {"batch_stats": None, "own_bias": None})
    randomise_norms(net, torch.Generator().manual_seed(2))  # the blocks now have a large fused bias
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        expanded = net(x)
        assert expanded_blocks(net)["own_bias"].equivalent()[1].abs().max() > 0.1
        fuse_model(net)
        assert (net(x) - expanded).abs().max() <= 1e-10
    assert net.own_bias.bias is not None and net.batch_stats.bias is None


def test_round_trip_plain_dbb_plain_reproduces_the_weights_and_keys() -> None:
    net = resnet()
    before = _snapshot(net)
    sites = find_sites(net, (3, 32, 32))
    blocks = expand_model(
        net,
        sites,
        {sites[0].name: None, sites[7].name: None, sites[12].name: None},
        batches=batches(3),
        generator=torch.Generator().manual_seed(0),
    )
    assert set(blocks) == {sites[0].name, sites[7].name, sites[12].name}
    assert isinstance(net.get_submodule(sites[7].name), DiverseBranchBlock)
    assert fuse_model(net) == [sites[0].name, sites[7].name, sites[12].name]
    after = _snapshot(net)
    assert {k: (v.shape, v.dtype) for k, v in after.items()} == {
        k: (v.shape, v.dtype) for k, v in before.items()
    }
    for key in before:
        assert torch.allclose(after[key], before[key], atol=1e-12, rtol=0), key
    conv = net.get_submodule(sites[7].name)
    assert type(conv) is SlimConv2d and conv.bias is None and conv.global_out == 32


def test_bias_folded_into_the_following_bn_keeps_resnet_outputs() -> None:
    net = resnet()
    sites = find_sites(net, (3, 32, 32))
    expand_model(net, sites, {sites[2].name: None, sites[9].name: None}, batches=batches(3))
    for block in expanded_blocks(net).values():
        randomise_norms(block, torch.Generator().manual_seed(3))  # as if trained: non-zero fused bias
    x = batches(1, seed=7)[0]
    with torch.no_grad():
        expanded = net(x)
        fuse_model(net)
        assert (net(x) - expanded).abs().max() <= 1e-10


def test_capacity_zero_leaves_the_model_untouched() -> None:
    net = resnet()
    modules = dict(net.named_modules())
    before = _snapshot(net)
    sites = find_sites(net, (3, 32, 32))
    assert expand_model(net, sites, {}, batches=batches(2)) == {}
    assert fuse_model(net) == []
    assert dict(net.named_modules()) == modules
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


def test_stored_branches_come_back_and_the_function_is_the_new_global_one() -> None:
    net = resnet()
    sites = find_sites(net, (3, 32, 32))
    name = sites[4].name
    block = expand_model(net, sites, {name: None})[name]
    randomise_norms(block, torch.Generator().manual_seed(5))
    stored = branch_state(block)
    assert stored and not any(k.startswith("branches.kxk.") for k in stored)
    fuse_model(net)
    with torch.no_grad():
        net.get_submodule(name).weight.mul_(0.5)  # a "new global model"
    x = batches(1, seed=7)[0]
    with torch.no_grad():
        reference = net(x)
    block = expand_model(net, sites, {name: None}, branch_states={name: stored})[name]
    kept = block.state_dict()
    assert all(torch.equal(kept[k], v) for k, v in stored.items())
    with torch.no_grad():
        assert (net(x) - reference).abs().max() <= 1e-10


def test_expansion_errors_name_what_is_wrong() -> None:
    net = resnet()
    sites = find_sites(net, (3, 32, 32))
    with pytest.raises(ValueError, match="not expandable convs of this model: \\['blocks.0.shortcut'\\]"):
        expand_model(net, sites, {"blocks.0.shortcut": None})
    expand_model(net, sites, {"stem.conv": None})
    with pytest.raises(ValueError, match="not a plain conv: fuse the model first"):
        expand_model(net, sites, {"stem.conv": None})
    with pytest.raises(ValueError, match="needs the plain model"):
        find_sites(net, (3, 32, 32))
    with pytest.raises(ValueError, match="not a Diverse Branch Block"):
        fuse_block(net, "blocks.0.conv1")
    with pytest.raises(ValueError, match="stored branches of 'blocks.0.conv1' do not match"):
        expand_model(net, sites, {"blocks.0.conv1": ["conv1x1"]}, branch_states={"blocks.0.conv1": {}})


def test_site_records_are_json() -> None:
    site = find_sites(resnet(), (3, 32, 32))[5]
    assert ConvSite.from_dict(json.loads(json.dumps(site.to_dict()))) == site
    with pytest.raises(ValueError, match="malformed conv site record"):
        ConvSite.from_dict({"name": "x"})
