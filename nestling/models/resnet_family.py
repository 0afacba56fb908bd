"""The ResNet-like families (CIFAR ResNets, PreResNet, ResNet-18/34, the tiny CNN): one class, many instances.

Everything about their structure lives here: the stem, the block and exit choice. The profiler derives their
costs by running them (profiler/trace.py) and export folds them generically (export/standalone.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from nestling.errors import ConfigError, SpecError
from nestling.models.blocks import BasicBlock, PreActBlock
from nestling.models.context import BuildContext
from nestling.models.family import ExportKit, GrowthCells, ModelFamily, NeflPreset
from nestling.models.heads import PoolClassifier, make_exit, standalone_exit
from nestling.models.net import BlockInfo

if TYPE_CHECKING:
    from nestling.spec import SubmodelSpec


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


@dataclass(frozen=True)
class ResNetFamily(ModelFamily):
    """A ResNet-like family: stem width, per-stage widths and depths, block kind."""

    name: str = field()  # field(): the base class's `name = ""` must not become a default
    stem_width: int
    stage_widths: tuple[int, ...]
    depths: tuple[int, ...]
    preact: bool
    max_pool: bool = False  # NeFL ResNet18/34: 3×3 max-pool stride 2 after the stem
    first_stride: int = 1
    paper: str = ""
    nefl_depth_masks: tuple[tuple[int, ...], ...] | None = None
    nefl_wd: tuple[tuple[float, tuple[int, ...] | None], ...] | None = None
    groupable: bool = True  # every layer is per-channel once grouped

    supports_layout = (
        True  # extra["layout"] (FedTrans's grown models) sets blocks per stage and internal widths
    )

    def stage_depths(self, extra: dict[str, Any]) -> tuple[int, ...]:
        layout = self._layout(extra)
        return self.depths if layout is None else tuple(layout["stage_blocks"])

    def block_hidden(self, image_size: int, extra: dict[str, Any]) -> tuple[int, ...]:
        """Every block's global internal width (conv1's outputs): the stage width unless a layout grew it."""
        layout = self._layout(extra)
        if layout is not None:
            return tuple(layout["block_hidden"])
        return tuple(info.global_out for info in self.block_infos(image_size, extra))

    def _layout(self, extra: dict[str, Any]) -> dict[str, list[int]] | None:
        layout = extra.get("layout")
        if layout is None:
            return None
        if len(layout["stage_blocks"]) != len(self.stage_widths):
            raise ConfigError(
                f"[model] extra.layout.stage_blocks {layout['stage_blocks']} must list the "
                f"{len(self.stage_widths)} stages of {self.name}"
            )
        return layout  # ModelConfig validated the rest (nestling.models.config.validated_layout)

    # -- structure -----------------------------------------------------------------------------
    def block_infos(self, image_size: int, extra: dict[str, Any]) -> tuple[BlockInfo, ...]:
        infos: list[BlockInfo] = []
        channels, size = self.stem_width, image_size
        if self.max_pool:
            size = (size + 1) // 2
        for stage, (width, depth) in enumerate(zip(self.stage_widths, self.stage_depths(extra))):
            for j in range(depth):
                stride = (self.first_stride if stage == 0 else 2) if j == 0 else 1
                out_size = (size + stride - 1) // stride
                infos.append(BlockInfo(len(infos), stage, channels, width, stride, size, out_size))
                channels, size = width, out_size
        return tuple(infos)

    def build_parts(
        self, spec: SubmodelSpec, ctx: BuildContext, infos: tuple[BlockInfo, ...], kept: set[int], depth: int
    ) -> tuple[nn.Module, list[nn.Module], dict[int, nn.Module], nn.Module | None]:
        stem = ConvStem(ctx, self.stem_width, relu=not self.preact, max_pool=self.max_pool)
        block_cls = PreActBlock if self.preact else BasicBlock
        hidden = self.block_hidden(spec.model.image_size, spec.model.extra)
        blocks: list[nn.Module] = [
            block_cls(
                ctx,
                info.global_in,
                info.global_out,
                info.stride,
                skipped=info.index not in kept,
                hidden_ratio=None if spec.block_widths is None else spec.block_widths[info.index],
                global_hidden=hidden[info.index],
            )
            for info in infos[:depth]
        ]
        final = self.stage_widths[-1]
        exits = {e: make_exit(ctx, infos[e].global_out, final, preact=self.preact) for e in spec.exits}
        head = PoolClassifier(ctx, final, with_norm=self.preact) if spec.head else None
        return stem, blocks, exits, head

    # -- export --------------------------------------------------------------------------------
    def standalone_part(self, part: nn.Module, kit: ExportKit) -> nn.Module | None:
        if isinstance(part, ConvStem):
            layers = kit.fold_chain([part.conv, part.scale, part.bn])
            if part.relu:
                layers.append(nn.ReLU())
            if part.max_pool:
                layers.append(nn.MaxPool2d(3, 2, 1))
            return nn.Sequential(*layers)
        if isinstance(part, BasicBlock):
            return _standalone_basic(part, kit)
        if isinstance(part, PreActBlock):
            return _standalone_preact(part, kit)
        if isinstance(part, PoolClassifier):
            pre: nn.Module = nn.Identity()
            if part.norm is not None and part.scale is not None and part.relu:
                pre = kit.pre_activation(part.norm, kit.scaler_factor(part.scale))
            elif part.norm is not None and part.scale is not None:  # FeDepth's exits: no ReLU (§3.a.8)
                pre = kit.ChannelAffine(kit.bn_affine(part.norm, kit.scaler_factor(part.scale)))
            return kit.PoolLinear(pre, kit.plain_linear(part.fc))
        converted = standalone_exit(part, kit)  # a method's exit head (ScaleFL's, DepthFL's) folds itself
        if converted is not None:
            return converted
        raise SpecError(f"export does not know the {type(part).__name__} of model family '{self.name}'")

    # -- method questions ----------------------------------------------------------------------
    def nefl_depth_preset(self) -> list[tuple[int, ...]] | None:
        return None if self.nefl_depth_masks is None else list(self.nefl_depth_masks)

    def nefl_wd_preset(self) -> NeflPreset | None:
        return None if self.nefl_wd is None else list(self.nefl_wd)

    def growth_cells(self, extra: dict[str, Any]) -> GrowthCells:
        """FedTrans grows the block-internal width (conv1's outputs and the BN after conv1) and inserts blocks
        whose residual branch is zeroed at its last layer: BasicBlock's bn2 γ = β = 0 (y = ReLU(0 + x) = x, x
        being a ReLU output), PreActBlock's conv2 (no BN follows it; zeroing bn2 would leave the branch
        without a gradient since ReLU'(0) = 0)."""
        norm = "bn2" if self.preact else "bn1"  # the BN between conv1 and conv2
        stats = ("weight", "bias", "running_mean", "running_var")
        return GrowthCells(
            producer="conv1.weight",
            rows=("conv1.weight", "conv1.bias", *(f"{norm}.{name}" for name in stats)),
            consumer="conv2.weight",
            zeroed=("conv2.weight",) if self.preact else ("bn2.weight", "bn2.bias"),
            inserted_hidden=tuple(self.stage_widths),
        )


# -- export: residual blocks folded into plain convolutions ----------------------------------------------------
def _step(block: BasicBlock | PreActBlock) -> torch.Tensor:
    return block.step.detach().double().reshape(-1)


def _standalone_basic(block: BasicBlock, kit: ExportKit) -> nn.Module | None:
    shortcut = nn.Sequential(*kit.fold_chain(list(block.shortcut))) if block.has_projection else None
    if block.skipped:
        # Skipped post-activation block: ReLU(P(x)); without P its input is already a ReLU output.
        return None if shortcut is None else nn.Sequential(shortcut, nn.ReLU())
    conv2 = kit.fold_conv(
        block.conv2,
        post=kit.scale_affine(kit.bn_affine(block.bn2, kit.scaler_factor(block.scale2)), _step(block)),
    )
    body = nn.Sequential(*kit.fold_chain([block.conv1, block.scale1, block.bn1]), nn.ReLU(), conv2)
    return kit.Residual(body, shortcut)


def _standalone_preact(block: PreActBlock, kit: ExportKit) -> nn.Module | None:
    if block.skipped and not block.has_projection:
        return None
    pre = kit.pre_activation(block.bn1, kit.scaler_factor(block.scale1))
    projection: nn.Conv2d | None = None
    if block.has_projection:
        _, conv = block.shortcut
        assert isinstance(conv, nn.Conv2d)
        projection = kit.fold_conv(conv)
    if block.skipped:
        assert projection is not None
        return nn.Sequential(pre, projection)
    conv1 = kit.fold_conv(
        block.conv1,
        post=kit.bn_affine(block.bn2, kit.scaler_factor(block.scale2)),
    )
    conv2 = kit.fold_conv(
        block.conv2,
        post=(
            _step(block).expand(block.conv2.out_channels),
            torch.zeros(block.conv2.out_channels, dtype=torch.float64),
        ),
    )
    return kit.PreActResidual(pre, nn.Sequential(conv1, nn.ReLU(), conv2), projection)
