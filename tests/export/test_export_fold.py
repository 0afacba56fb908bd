"""Folding: the standalone module computes what the ScalableNet does, for every block, head, BN policy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nestling.errors import SpecError
from nestling.export.fold import bn_affine, fold_conv, scale_affine, scaler_factor
from nestling.export.standalone import build_standalone, plan_outputs, reference_outputs
from nestling.models import ModelConfig, build, set_active_width
from nestling.models.layers import Scaler, SlimBatchNorm2d
from nestling.spec import SubmodelSpec


@torch.no_grad()
def _trained_like(spec: SubmodelSpec, seed: int = 0) -> nn.Module:
    """A submodel with random BN statistics and affine, and step sizes away from 1, in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    net = build(spec)
    for module in net.modules():
        if isinstance(module, SlimBatchNorm2d):
            for name, buffer in module.named_buffers():
                if "mean" in name:
                    buffer.copy_(torch.rand(buffer.shape, generator=generator) * 0.4 - 0.2)
                elif "var" in name:
                    buffer.copy_(torch.rand(buffer.shape, generator=generator) * 1.5 + 0.5)
            module.weight.copy_(torch.rand(module.weight.shape, generator=generator) + 0.5)
            module.bias.copy_(torch.rand(module.bias.shape, generator=generator) * 0.4 - 0.2)
    for name, parameter in net.named_parameters():
        if name.split(".")[-1].startswith("step"):
            parameter.copy_(torch.rand(1, generator=generator) + 0.5)
    if spec.model.norm_stats == "per_width":
        set_active_width(net, spec.width)
    return net.eval()


CASES = {
    "nefl-wd resnet20 (skipped blocks)": SubmodelSpec(
        ModelConfig("resnet20"), width=0.67, blocks=(0, 1, 3, 4, 6, 7)
    ),
    "preresnet20 (FeDepth)": SubmodelSpec(ModelConfig("preresnet20"), width=0.5, blocks=(0, 2, 3, 6)),
    "scalefl exits + Scaler": SubmodelSpec(
        ModelConfig("resnet20", scaler="always", rounding="floor", exit_kind="scalefl", exit_points=(2, 5)),
        width=0.4,
        depth=6,
        exits=(2, 5),
        head=False,
    ),
    "depthfl gated exits": SubmodelSpec(
        ModelConfig("resnet20", exit_points=(2, 5), exit_kind="depthfl"), exits=(2, 5)
    ),
    "fedepth exits (BN, no ReLU)": SubmodelSpec(
        ModelConfig("preresnet20", exit_points=(2, 5), exit_kind="fedepth"), width=0.5, exits=(2, 5)
    ),
    "fjord per-width BN": SubmodelSpec(
        ModelConfig("resnet20", norm_stats="per_width", width_levels=(0.5, 1.0)), width=0.5
    ),
    "heterofl Scaler (train only)": SubmodelSpec(ModelConfig("preresnet20", scaler="train"), width=0.25),
    "vit with steps": SubmodelSpec(
        ModelConfig("vit", exit_points=(2,)), width=0.5, blocks=(0, 1, 2, 4), exits=(2,)
    ),
    "resnet18 max-pool stem": SubmodelSpec(
        ModelConfig("resnet18", image_size=32, exit_points=(3,)), width=0.25, exits=(3,)
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("outputs", [{}, {"all_exits": True}, {"ensemble": True}])
def test_standalone_matches_the_scalable_net(case: str, outputs: dict) -> None:
    spec = CASES[case]
    net = _trained_like(spec)
    plan = plan_outputs(net, **outputs)
    standalone = build_standalone(net, plan)
    x = torch.randn(3, spec.model.in_channels, spec.model.image_size, spec.model.image_size)
    with torch.no_grad():
        expected = reference_outputs(net, plan, x)
        got = standalone(x)
    got = [got] if isinstance(got, torch.Tensor) else list(got)
    assert len(got) == len(expected) == len(plan.names)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))


def test_standalone_holds_only_plain_layers_and_no_batchnorm() -> None:
    net = _trained_like(CASES["scalefl exits + Scaler"])
    standalone = build_standalone(net, plan_outputs(net, all_exits=True))
    kinds = {type(m).__name__ for m in standalone.modules()}
    assert not kinds & {"SlimConv2d", "SlimBatchNorm2d", "BatchNorm2d", "Scaler", "SlimLinear"}
    assert sum(p.numel() for p in standalone.parameters()) < sum(p.numel() for p in net.parameters())


def test_step_size_folds_into_the_preceding_batchnorm() -> None:
    bn = nn.BatchNorm2d(4).eval()
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
        bn.running_var.copy_(torch.tensor([0.5, 1.0, 2.0, 4.0]))
        bn.weight.copy_(torch.tensor([1.5, 0.5, 1.0, 2.0]))
        bn.bias.copy_(torch.tensor([0.1, 0.2, -0.3, 0.0]))
    x = torch.randn(2, 4, 3, 3)
    scale, shift = scale_affine(bn_affine(bn), 0.7)
    folded = x * scale.float().view(1, -1, 1, 1) + shift.float().view(1, -1, 1, 1)
    torch.testing.assert_close(folded, 0.7 * bn(x))


def test_conv_bn_fold_includes_the_scaler_constant() -> None:
    conv, bn = nn.Conv2d(3, 5, 3, padding=1, bias=False), nn.BatchNorm2d(5)
    bn.train()
    bn(conv(torch.randn(8, 3, 6, 6)) * 2.0)  # give the BN real statistics
    bn.eval()
    scaler = Scaler(0.5, "always").eval()
    x = torch.randn(2, 3, 6, 6)
    folded = fold_conv(conv, post=bn_affine(bn, scaler_factor(scaler)))
    with torch.no_grad():
        torch.testing.assert_close(folded(x), bn(scaler(conv(x))), rtol=1e-5, atol=1e-5)
    assert scaler_factor(Scaler(0.5, "train").eval()) == 1.0  # HeteroFL: the Scaler is off at inference


def test_batch_statistics_cannot_be_folded_without_calibration() -> None:
    spec = SubmodelSpec(ModelConfig("resnet20", norm_stats="batch"), width=0.5)
    net = build(spec).eval()
    with pytest.raises(SpecError, match="calibrate"):
        build_standalone(net, plan_outputs(net))


def test_unknown_exit_names_the_available_outputs() -> None:
    net = build(CASES["depthfl gated exits"]).eval()
    with pytest.raises(SpecError, match="exits after blocks 2, 5, head"):
        plan_outputs(net, exit="4")
    with pytest.raises(SpecError, match="either one exit or all"):
        plan_outputs(net, exit="2", all_exits=True)
    assert plan_outputs(net, exit="2").taps == ("exit2",)
    assert plan_outputs(net, ensemble=True).combine == "mean"
