"""Where HeteroFL's Scaler sits (METHODS §7.1): in front of every normalisation layer, and nowhere else.

A train-only ×1/r in front of a layer whose output no norm follows (e.g. a 1×1 projection shortcut added to
the residual) makes training and evaluation different networks; in front of a norm it is harmless in training
and lets the statistics match. Checked by running every family's model, not by reading one block.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from torch import nn

from nestling.models.config import ModelConfig
from nestling.models.layers import Scaler, SlimBatchNorm2d, SlimLayerNorm
from nestling.models.zoo import build, known_models
from nestling.spec import SubmodelSpec

NORMS = (SlimBatchNorm2d, SlimLayerNorm, nn.BatchNorm2d, nn.LayerNorm)


def _feeds(model: nn.Module, x: torch.Tensor) -> dict[str, str]:
    """For every Scaler, the kind of the next module that consumes its output (by forward order)."""
    order: list[tuple[str, nn.Module]] = []
    hooks = [
        module.register_forward_pre_hook(lambda m, _inp, name=name: order.append((name, m)))
        for name, module in model.named_modules()
        if not list(module.children())
    ]
    try:
        model(x)
    finally:
        for hook in hooks:
            hook.remove()
    fed: dict[str, str] = {}
    for (name, module), (_, following) in pairwise(order):
        if isinstance(module, Scaler):
            fed[name] = type(following).__name__
    return fed


@pytest.mark.parametrize("arch", [a for a in known_models() if a != "vit"])
def test_every_scaler_feeds_a_norm(arch: str) -> None:
    image = 16 if arch != "resnet18" else 32
    model = build(
        SubmodelSpec(ModelConfig(arch, image_size=image, scaler="train", norm_stats="batch"), width=0.5)
    )
    model.train()
    fed = _feeds(model, torch.randn(2, 3, image, image))
    assert fed, f"{arch} has no Scaler at all"
    wrong = {name: kind for name, kind in fed.items() if kind not in {cls.__name__ for cls in NORMS}}
    assert not wrong, f"{arch}: Scalers feeding something other than a norm: {wrong}"
    norms = [n for n, m in model.named_modules() if isinstance(m, NORMS)]
    assert len(fed) == len(norms), f"{arch}: {len(norms)} norms but {len(fed)} Scalers in front of them"


@torch.no_grad()
def test_a_heterofl_preresnet_submodel_in_train_mode_is_the_eval_network_up_to_batch_statistics() -> None:
    """With BN statistics taken from the batch in both modes, a train-only Scaler in front of norms only
    cannot change the output: eval (no Scaler) must equal train (Scaler on) to float precision."""
    model = build(
        SubmodelSpec(ModelConfig("preresnet20", image_size=16, scaler="train", norm_stats="batch"), width=0.5)
    )
    x = torch.randn(8, 3, 16, 16)
    model.train()
    trained = model(x)
    for module in model.modules():
        if isinstance(module, Scaler):
            module.eval()
    plain = model(x)
    assert torch.allclose(trained, plain, atol=1e-4, rtol=1e-4), float((trained - plain).abs().max())
