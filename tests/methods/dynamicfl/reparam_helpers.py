"""Shared pieces of the reparam tests: random BN statistics/affines and a small zoo ResNet."""

from __future__ import annotations

import torch
from torch import nn

from nestling.models import ModelConfig, ScalableNet, build
from nestling.spec import SubmodelSpec


def randomise_norms(module: nn.Module, generator: torch.Generator) -> None:
    """Every BN gets random running statistics and affine parameters (eval-mode fusion must hold for any)."""
    with torch.no_grad():
        for bn in module.modules():
            if isinstance(bn, nn.BatchNorm2d):
                dtype = bn.weight.dtype
                n = bn.num_features
                if bn.running_mean is not None and bn.running_var is not None:
                    bn.running_mean.copy_(torch.randn(n, generator=generator, dtype=dtype))
                    bn.running_var.copy_(torch.rand(n, generator=generator, dtype=dtype) * 1.5 + 0.25)
                bn.weight.copy_(torch.rand(n, generator=generator, dtype=dtype) + 0.5)
                bn.bias.copy_(torch.randn(n, generator=generator, dtype=dtype))


def resnet(arch: str = "resnet20", *, dtype: torch.dtype = torch.float64, seed: int = 0) -> ScalableNet:
    """A zoo model with realistic running statistics (a few train-mode passes), in eval mode."""
    torch.manual_seed(seed)
    net = build(SubmodelSpec.full(ModelConfig(arch))).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    net.train()
    with torch.no_grad():
        for _ in range(3):
            net(torch.randn(8, 3, 32, 32, generator=generator, dtype=dtype))
    return net.eval()


def batches(
    count: int, *, dtype: torch.dtype = torch.float64, seed: int = 1, size: int = 8
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(size, 3, 32, 32, generator=generator, dtype=dtype) for _ in range(count)]
