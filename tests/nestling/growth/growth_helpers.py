"""Shared makers for the growth tests: small ResNets whose BN layers hold non-trivial statistics."""

from __future__ import annotations

import torch

from nestling.models import ModelConfig, build
from nestling.models.layers import SlimBatchNorm2d
from nestling.models.net import ScalableNet
from nestling.spec import SubmodelSpec

IMAGE = 8


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
