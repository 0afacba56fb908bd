"""The Vision Transformer (NeFL's ViT): patch embedding, pre-norm encoder blocks with step sizes, token head.

Dimensions default to VIT_DEFAULTS; a model config's `extra` overrides any of them. A FedTrans-grown ViT also
carries `extra["layout"]` (nestling.models.config.validated_layout): one stage, `stage_blocks = [depth]`, and
`block_hidden` = every encoder block's MLP hidden width (fc1's outputs), which then override `depth` and
`mlp_dim`. Attention keeps `heads` × dim/heads everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nestling.errors import ConfigError, SpecError
from nestling.models.blocks import EncoderBlock
from nestling.models.context import BuildContext
from nestling.models.family import ExportKit, GrowthCells, ModelFamily, register_family
from nestling.models.heads import TokenClassifier
from nestling.models.net import BlockInfo

if TYPE_CHECKING:
    from nestling.spec import SubmodelSpec

VIT_DEFAULTS = {"patch": 4, "dim": 128, "depth": 6, "heads": 4, "mlp_dim": 256}


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


@register_family
class VitFamily(ModelFamily):
    """One stage of `depth` encoder blocks over (image_size / patch)² + 1 tokens."""

    name = "vit"
    paper = "NeFL ViT"
    stem_trains_every_stage = True  # FeDepth §3.a.9: ViT stages all train the patch embedding

    supports_layout = True  # extra["layout"] (FedTrans's grown ViTs): encoder blocks and their MLP widths

    @staticmethod
    def config(extra: dict[str, Any]) -> dict[str, int]:
        return {**VIT_DEFAULTS, **{k: v for k, v in extra.items() if k != "layout"}}

    def _layout(self, extra: dict[str, Any]) -> dict[str, list[int]] | None:
        layout = extra.get("layout")
        if layout is not None and len(layout["stage_blocks"]) != 1:
            raise ConfigError(
                f"[model] extra.layout.stage_blocks {layout['stage_blocks']} must list the 1 stage of {self.name}"
            )
        return layout  # ModelConfig validated the rest (nestling.models.config.validated_layout)

    def stage_depths(self, extra: dict[str, Any]) -> tuple[int, ...]:
        layout = self._layout(extra)
        return (self.config(extra)["depth"],) if layout is None else (layout["stage_blocks"][0],)

    def block_hidden(self, image_size: int, extra: dict[str, Any]) -> tuple[int, ...]:
        """Every encoder block's global MLP hidden width: `mlp_dim` unless a layout grew it."""
        layout = self._layout(extra)
        if layout is not None:
            return tuple(layout["block_hidden"])
        return (self.config(extra)["mlp_dim"],) * self.stage_depths(extra)[0]

    def block_infos(self, image_size: int, extra: dict[str, Any]) -> tuple[BlockInfo, ...]:
        cfg = self.config(extra)
        tokens = (image_size // cfg["patch"]) ** 2 + 1
        depth = self.stage_depths(extra)[0]
        return tuple(BlockInfo(i, 0, cfg["dim"], cfg["dim"], 1, tokens, tokens) for i in range(depth))

    def build_parts(
        self, spec: SubmodelSpec, ctx: BuildContext, infos: tuple[BlockInfo, ...], kept: set[int], depth: int
    ) -> tuple[nn.Module, list[nn.Module], dict[int, nn.Module], nn.Module | None]:
        cfg = self.config(spec.model.extra)
        if spec.model.image_size % cfg["patch"]:
            raise SpecError(
                f"image_size {spec.model.image_size} is not a multiple of the ViT patch {cfg['patch']}"
            )
        mlp = self.block_hidden(spec.model.image_size, spec.model.extra)
        stem = PatchStem(ctx, cfg["dim"], cfg["patch"])
        blocks: list[nn.Module] = [
            EncoderBlock(
                ctx,
                cfg["dim"],
                cfg["heads"],
                mlp[i],
                skipped=i not in kept,
                hidden_ratio=None if spec.block_widths is None else spec.block_widths[i],
            )
            for i in range(depth)
        ]
        exits: dict[int, nn.Module] = {e: TokenClassifier(ctx, cfg["dim"]) for e in spec.exits}
        head = TokenClassifier(ctx, cfg["dim"]) if spec.head else None
        return stem, blocks, exits, head

    def standalone_part(self, part: nn.Module, kit: ExportKit) -> nn.Module | None:
        if isinstance(part, PatchStem):
            return kit.PatchEmbed(kit.fold_conv(part.proj), part.cls_token, part.pos_embed)
        if isinstance(part, EncoderBlock):
            return None if part.skipped else kit.Encoder(part)
        if isinstance(part, TokenClassifier):
            return kit.TokenHead(part)
        raise SpecError(f"export does not know the {type(part).__name__} of model family '{self.name}'")

    def growth_cells(self, extra: dict[str, Any]) -> GrowthCells:
        """FedTrans grows an encoder block's MLP hidden width (fc1's outputs; no norm sits between fc1 and fc2,
        and GELU is elementwise, so replicated units stay equal) and inserts pre-norm blocks whose two output
        projections (attention's proj and the MLP's fc2, weights and biases) are zero: both residual branches
        add exactly 0 in train and eval mode (LayerNorm has no running state), and both projections still
        receive a gradient because their inputs are not zero."""
        return GrowthCells(
            producer="fc1.weight",
            rows=("fc1.weight", "fc1.bias"),
            consumer="fc2.weight",
            zeroed=("proj.weight", "proj.bias", "fc2.weight", "fc2.bias"),
            inserted_hidden=(self.config(extra)["mlp_dim"],),
        )
