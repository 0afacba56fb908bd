"""Shared makers for the growth tests: small ResNets whose BN layers hold non-trivial statistics, and a tiny ViT
whose LayerNorms and biases are away from their initial values."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from nestling.models import ModelConfig, build
from nestling.models.blocks import EncoderBlock
from nestling.models.family import ModelFamily, register_family, unregister_family
from nestling.models.layers import SlimBatchNorm2d, SlimLayerNorm
from nestling.models.net import BlockInfo, ScalableNet
from nestling.spec import SubmodelSpec

IMAGE = 8
TINY_VIT = {"patch": 4, "dim": 16, "depth": 2, "heads": 2, "mlp_dim": 24}  # 5 tokens at 8x8, ~7k parameters


def tiny_vit(**changes: object) -> ModelConfig:
    """A two-block ViT small enough that a growth test takes milliseconds."""
    return ModelConfig("vit", image_size=IMAGE, extra=dict(TINY_VIT), **changes)  # type: ignore[arg-type]


def trained_looking(
    config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """A state as after training: random weights and BN affine/statistics far from their initial values."""
    torch.manual_seed(seed)
    net = build(SubmodelSpec(config)).to(dtype)
    for module in net.modules():
        if isinstance(module, SlimBatchNorm2d):
            with torch.no_grad():
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
                if module.running_mean is not None and module.running_var is not None:
                    module.running_mean.uniform_(-0.3, 0.3)
                    module.running_var.uniform_(0.5, 2.0)
        if isinstance(module, SlimLayerNorm):
            with torch.no_grad():
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
        if isinstance(module, EncoderBlock) and not module.skipped:  # the zoo zeroes biases
            with torch.no_grad():
                for linear in (module.q, module.k, module.v, module.proj, module.fc1, module.fc2):
                    linear.bias.uniform_(-0.2, 0.2)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def net_of(config: ModelConfig, state: dict[str, torch.Tensor], *, train: bool) -> ScalableNet:
    """The module of `config` holding `state` exactly (strict load), in train or eval mode."""
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    net = build(SubmodelSpec(config), init=False).to(dtype)
    net.load_state_dict(state, strict=True)
    return net.train(train)


def outputs(
    config: ModelConfig, state: dict[str, torch.Tensor], x: torch.Tensor, *, train: bool
) -> torch.Tensor:
    """Logits of the model on `x` (train mode uses batch statistics; the state is not touched)."""
    net = net_of(config, {k: v.clone() for k, v in state.items()}, train=train)
    with torch.no_grad():
        result = net(x)
    assert isinstance(result, torch.Tensor)
    return result


class _NoLayoutFamily(ModelFamily):
    """A registered family that answers no layout and no growth (every real family can now grow)."""

    name = "no-layout-test"

    def block_infos(self, image_size: int, extra: dict[str, Any]) -> tuple[BlockInfo, ...]:
        return (BlockInfo(0, 0, 4, 4, 1, 1, 1),)


@contextmanager
def family_without_layout() -> Iterator[str]:
    """Register a family FedTrans cannot grow for the duration; its arch name."""
    register_family(_NoLayoutFamily)
    try:
        yield _NoLayoutFamily.name
    finally:
        unregister_family(_NoLayoutFamily.name)
