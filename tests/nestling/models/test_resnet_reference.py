"""METHODS §2.b.6: with ρ = 1, every step size 1 and the same weights, the step-size ResNet equals a vanilla
ResNet. The vanilla forward is written out here with torch.nn.functional only, independent of the zoo."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nestling.models import ModelConfig, build
from nestling.spec import SubmodelSpec


def _bn(x: torch.Tensor, w: dict[str, torch.Tensor], name: str, training: bool) -> torch.Tensor:
    return F.batch_norm(
        x,
        w[f"{name}.running_mean"].clone(),
        w[f"{name}.running_var"].clone(),
        w[f"{name}.weight"],
        w[f"{name}.bias"],
        training,
        0.0,
        1e-5,
    )


def vanilla_resnet(
    x: torch.Tensor,
    w: dict[str, torch.Tensor],
    *,
    blocks: int,
    strides: list[int],
    max_pool: bool,
    training: bool,
) -> torch.Tensor:
    """He et al. BasicBlock ResNet: y = ReLU(BN2(conv2(ReLU(BN1(conv1 x)))) + shortcut(x)), option-B projection."""
    x = F.relu(_bn(F.conv2d(x, w["stem.conv.weight"], padding=1), w, "stem.bn", training))
    if max_pool:
        x = F.max_pool2d(x, 3, 2, 1)
    for b in range(blocks):
        p = f"blocks.{b}"
        out = F.conv2d(x, w[f"{p}.conv1.weight"], stride=strides[b], padding=1)
        out = F.relu(_bn(out, w, f"{p}.bn1", training))
        out = _bn(F.conv2d(out, w[f"{p}.conv2.weight"], padding=1), w, f"{p}.bn2", training)
        if f"{p}.shortcut.0.weight" in w:
            skip = _bn(
                F.conv2d(x, w[f"{p}.shortcut.0.weight"], stride=strides[b]), w, f"{p}.shortcut.2", training
            )
        else:
            skip = x
        x = F.relu(out + skip)
    x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
    return F.linear(x, w["head.fc.weight"], w["head.fc.bias"])


def randomised(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Non-trivial BN affine and running statistics so that every BN tensor matters."""
    generator = torch.Generator().manual_seed(1)
    state = net.state_dict()
    for key, value in state.items():
        if key.endswith(("bn1.weight", "bn2.weight", "bn.weight", "2.weight")) and value.dim() == 1:
            value.copy_(1 + 0.2 * torch.randn(value.shape, generator=generator))
        elif key.endswith((".bias", "running_mean")) and value.dim() == 1:
            value.copy_(0.1 * torch.randn(value.shape, generator=generator))
        elif key.endswith("running_var"):
            value.copy_(0.5 + torch.rand(value.shape, generator=generator))
    net.load_state_dict(state)
    return {k: v.clone() for k, v in state.items()}


@pytest.mark.parametrize(
    ("arch", "strides", "max_pool"),
    [
        ("resnet18", [1, 1, 2, 1, 2, 1, 2, 1], True),
        ("resnet18-cifar", [1, 1, 2, 1, 2, 1, 2, 1], False),  # kuangliu's (FjORD, DepthFL): no max-pool
        ("resnet20", [1, 1, 1, 2, 1, 1, 2, 1, 1], False),
    ],
)
@pytest.mark.parametrize("training", [False, True])
def test_full_width_unit_step_resnet_equals_the_vanilla_resnet(
    arch: str, strides: list[int], max_pool: bool, training: bool
) -> None:
    torch.manual_seed(0)
    net = build(SubmodelSpec.full(ModelConfig(arch, num_classes=10, image_size=16)))
    weights = randomised(net)
    assert all(float(v) == 1.0 for k, v in weights.items() if k.endswith(".step"))
    net.train(training)
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        ours = net(x)
        theirs = vanilla_resnet(
            x, weights, blocks=len(strides), strides=strides, max_pool=max_pool, training=training
        )
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
