"""The model zoo: every registered model family builds any of its submodels (METHODS §1.5).

The families live in their own modules (family_*.py, sharing resnet_family.py) and register themselves with
`nestling.models.family.register_family`; this module is the stable entry point the rest of the code calls.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from nestling.models.family import family_of, kept_blocks, registered_families
from nestling.models.heads import exit_head
from nestling.models.layers import SlimLinear
from nestling.models.net import BlockInfo, ScalableNet

if TYPE_CHECKING:  # nestling.spec imports nestling.models: a runtime import here would be circular
    from nestling.spec import SubmodelSpec


def _import_family_modules() -> None:
    """Import every nestling/models/family_*.py: each registers its families, so adding one is one module."""
    for module in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
        if module.name.startswith("family_"):
            importlib.import_module(f"nestling.models.{module.name}")


_import_family_modules()

__all__ = ["block_infos", "build", "kept_blocks", "known_models"]


def block_infos(
    spec_or_arch: SubmodelSpec | str, image_size: int = 32, extra: dict | None = None
) -> tuple[BlockInfo, ...]:
    """Global geometry of every block of an architecture."""
    if not isinstance(spec_or_arch, str):  # a SubmodelSpec
        model = spec_or_arch.model
        return block_infos(model.arch, model.image_size, model.extra)
    return family_of(spec_or_arch).block_infos(image_size, extra or {})


def known_models() -> list[str]:
    return list(registered_families())


def _init_weights(net: nn.Module) -> None:
    """Kaiming-normal convs and linears (NeFL ResNet_c_WD), zero biases."""
    for module in net.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(
                module.weight, mode="fan_out" if isinstance(module, nn.Conv2d) else "fan_in"
            )
            if module.bias is not None:
                nn.init.zeros_(module.bias)


def build(spec: SubmodelSpec, *, device: torch.device | str | None = None, init: bool = True) -> ScalableNet:
    """Make the physically smaller module of `spec` (a board never allocates the full model)."""
    family = family_of(spec.model.arch)
    exit_head(spec.model.exit_kind)  # an unknown kind is refused even when this submodel keeps no exit
    if device is not None and str(device) == "meta":
        with torch.device("meta"):
            return family.build(spec)
    net = family.build(spec)
    if init:
        _init_weights(net)
    return net.to(device) if device is not None else net


def class_logit_keys(spec: SubmodelSpec) -> set[str]:
    """State-dict keys of every layer that emits class logits (the head's and any exit's), found by what the
    layer is (a linear whose outputs are never sliced) rather than by its name, so every family is covered."""
    net = build(spec, device="meta")
    return {
        f"{name}.{tensor}"
        for name, module in net.named_modules()
        if isinstance(module, SlimLinear) and not module.slim_out
        for tensor, _ in module.named_parameters(recurse=False)
    }
