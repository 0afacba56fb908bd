"""The model zoo: each architecture as a blueprint that builds any of its submodels (METHODS §1.5)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from nestling.errors import ConfigError, SpecError
from nestling.models.blocks import BasicBlock, EncoderBlock, PreActBlock
from nestling.models.context import BuildContext
from nestling.models.heads import PoolClassifier, TokenClassifier, make_exit
from nestling.models.net import BlockInfo, ScalableNet

if TYPE_CHECKING:  # nestling.spec imports nestling.models: a runtime import here would be circular
    from nestling.spec import SubmodelSpec


@dataclass(frozen=True)
class ConvFamily:
    """A ResNet-like family: stem width, per-stage widths and depths, block kind."""

    stem_width: int
    stage_widths: tuple[int, ...]
    stage_depths: tuple[int, ...]
    preact: bool
    max_pool: bool = False  # NeFL ResNet18/34: 3×3 max-pool stride 2 after the stem
    first_stride: int = 1
    paper: str = ""


CONV_FAMILIES: dict[str, ConvFamily] = {
    "tinycnn": ConvFamily(8, (8, 16), (1, 1), preact=False, paper="(test model)"),
    "resnet20": ConvFamily(16, (16, 32, 64), (3, 3, 3), preact=False, paper="He et al. 2016"),
    "resnet56": ConvFamily(16, (16, 32, 64), (9, 9, 9), preact=False, paper="NeFL ResNet_c_WD"),
    "resnet110": ConvFamily(16, (16, 32, 64), (18, 18, 18), preact=False, paper="NeFL / ScaleFL"),
    "preresnet20": ConvFamily(16, (16, 32, 64), (3, 3, 3), preact=True, paper="FeDepth PreResNet-20"),
    "resnet18": ConvFamily(64, (64, 128, 256, 512), (2, 2, 2, 2), preact=False, max_pool=True, paper="NeFL ResNet_WD"),
    "resnet34": ConvFamily(64, (64, 128, 256, 512), (3, 4, 6, 3), preact=False, max_pool=True, paper="NeFL ResNet_WD"),
}

VIT_DEFAULTS = {"patch": 4, "dim": 128, "depth": 6, "heads": 4, "mlp_dim": 256}


class ConvStem(nn.Module):
    """3×3 conv (all image channels kept) → BN [→ ReLU] [→ max-pool]."""

    def __init__(self, ctx: BuildContext, width: int, *, relu: bool, max_pool: bool) -> None:
        super().__init__()
        self.conv = ctx.conv(ctx.model.in_channels, width, 3, image_input=True)
        self.scale = ctx.scaler()
        self.bn = ctx.norm(width)
        self.relu = relu
        self.max_pool = max_pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.scale(self.conv(x)))
        if self.relu:
            x = F.relu(x)
        if self.max_pool:
            x = F.max_pool2d(x, 3, 2, 1)
        return x


class PatchStem(nn.Module):
    """Patch embedding + class token + learned positions (ViT)."""

    def __init__(self, ctx: BuildContext, dim: int, patch: int) -> None:
        super().__init__()
        n = ctx.channels(dim)
        tokens = (ctx.model.image_size // patch) ** 2
        self.proj = nn.Conv2d(ctx.model.in_channels, n, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, n))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, n) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.pos_embed


def conv_block_infos(family: ConvFamily, image_size: int) -> tuple[BlockInfo, ...]:
    infos: list[BlockInfo] = []
    channels, size = family.stem_width, image_size
    if family.max_pool:
        size = (size + 1) // 2
    for stage, (width, depth) in enumerate(zip(family.stage_widths, family.stage_depths)):
        for j in range(depth):
            stride = (family.first_stride if stage == 0 else 2) if j == 0 else 1
            out_size = (size + stride - 1) // stride
            infos.append(BlockInfo(len(infos), stage, channels, width, stride, size, out_size))
            channels, size = width, out_size
    return tuple(infos)


def vit_block_infos(model_extra: dict, image_size: int) -> tuple[BlockInfo, ...]:
    cfg = {**VIT_DEFAULTS, **model_extra}
    tokens = (image_size // cfg["patch"]) ** 2 + 1
    return tuple(BlockInfo(i, 0, cfg["dim"], cfg["dim"], 1, tokens, tokens) for i in range(cfg["depth"]))


def block_infos(spec_or_arch: SubmodelSpec | str, image_size: int = 32, extra: dict | None = None) -> tuple[BlockInfo, ...]:
    """Global geometry of every block of an architecture."""
    if not isinstance(spec_or_arch, str):  # a SubmodelSpec
        model = spec_or_arch.model
        return block_infos(model.arch, model.image_size, model.extra)
    if spec_or_arch in CONV_FAMILIES:
        return conv_block_infos(CONV_FAMILIES[spec_or_arch], image_size)
    if spec_or_arch == "vit":
        return vit_block_infos(extra or {}, image_size)
    raise ConfigError(f"[model] unknown model '{spec_or_arch}' (known: {', '.join(known_models())})")


def known_models() -> list[str]:
    return [*CONV_FAMILIES, "vit"]


def _kept_blocks(spec: SubmodelSpec, count: int) -> tuple[set[int], int]:
    depth = count if spec.depth is None else spec.depth
    if depth > count:
        raise SpecError(f"depth {depth} exceeds the {count} blocks of {spec.model.arch}")
    kept = set(range(count)) if spec.blocks is None else set(spec.blocks)
    outside = sorted(b for b in kept if not 0 <= b < count)
    if outside:
        raise SpecError(f"blocks {outside} do not exist in {spec.model.arch} (0..{count - 1})")
    kept &= set(range(depth))
    if not kept:
        raise SpecError(f"submodel of {spec.model.arch} keeps no residual block")
    late_exits = [e for e in spec.exits if e >= depth]
    if late_exits:
        raise SpecError(f"exits {late_exits} lie beyond the submodel's depth {depth}")
    if spec.block_widths is not None and len(spec.block_widths) != count:
        raise SpecError(f"block_widths has {len(spec.block_widths)} entries, {spec.model.arch} has {count} blocks")
    return kept, depth


def _build_conv(spec: SubmodelSpec, family: ConvFamily) -> ScalableNet:
    ctx = BuildContext(spec.model, spec.width)
    infos = conv_block_infos(family, spec.model.image_size)
    kept, depth = _kept_blocks(spec, len(infos))
    stem = ConvStem(ctx, family.stem_width, relu=not family.preact, max_pool=family.max_pool)
    block_cls = PreActBlock if family.preact else BasicBlock
    blocks = [
        block_cls(ctx, info.global_in, info.global_out, info.stride, skipped=info.index not in kept,
                  hidden_ratio=None if spec.block_widths is None else spec.block_widths[info.index])
        for info in infos[:depth]
    ]
    final = family.stage_widths[-1]
    exits = {e: make_exit(ctx, infos[e].global_out, final, preact=family.preact) for e in spec.exits}
    head = PoolClassifier(ctx, final, with_norm=family.preact) if spec.head else None
    return ScalableNet(stem, blocks, exits, head, infos, spec.model.arch)


def _build_vit(spec: SubmodelSpec) -> ScalableNet:
    cfg = {**VIT_DEFAULTS, **spec.model.extra}
    if spec.model.image_size % cfg["patch"]:
        raise SpecError(f"image_size {spec.model.image_size} is not a multiple of the ViT patch {cfg['patch']}")
    ctx = BuildContext(spec.model, spec.width)
    infos = vit_block_infos(spec.model.extra, spec.model.image_size)
    kept, depth = _kept_blocks(spec, len(infos))
    stem = PatchStem(ctx, cfg["dim"], cfg["patch"])
    blocks = [
        EncoderBlock(ctx, cfg["dim"], cfg["heads"], cfg["mlp_dim"], skipped=i not in kept,
                     hidden_ratio=None if spec.block_widths is None else spec.block_widths[i])
        for i in range(depth)
    ]
    exits = {e: TokenClassifier(ctx, cfg["dim"]) for e in spec.exits}
    head = TokenClassifier(ctx, cfg["dim"]) if spec.head else None
    return ScalableNet(stem, blocks, exits, head, infos, spec.model.arch)


def _init_weights(net: nn.Module) -> None:
    """Kaiming-normal convs and linears (NeFL ResNet_c_WD), zero biases."""
    for module in net.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(module.weight, mode="fan_out" if isinstance(module, nn.Conv2d) else "fan_in")
            if module.bias is not None:
                nn.init.zeros_(module.bias)


def build(spec: SubmodelSpec, *, device: torch.device | str | None = None, init: bool = True) -> ScalableNet:
    """Make the physically smaller module of `spec` (a board never allocates the full model)."""
    arch = spec.model.arch
    builder: Callable[[], ScalableNet]
    if arch in CONV_FAMILIES:
        builder = lambda: _build_conv(spec, CONV_FAMILIES[arch])  # noqa: E731
    elif arch == "vit":
        builder = lambda: _build_vit(spec)  # noqa: E731
    else:
        raise ConfigError(f"[model] unknown model '{arch}' (known: {', '.join(known_models())})")
    if device is not None and str(device) == "meta":
        with torch.device("meta"):
            return builder()
    net = builder()
    if init:
        _init_weights(net)
    return net.to(device) if device is not None else net
