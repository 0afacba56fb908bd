"""ScalableNet: stem → ordered residual blocks (in stages) → head, with exits after chosen blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class BlockInfo:
    """Global geometry of one residual block, used by slicing, the profiler and depth-wise training."""

    index: int
    stage: int
    global_in: int
    global_out: int
    stride: int
    in_size: int  # spatial side (or token count for ViT) entering the block
    out_size: int


class ScalableNet(nn.Module):
    """A (sub)model of one architecture family. Built only through `nestling.models.build`.

    forward returns one logits tensor when the submodel has a single output, otherwise the list of
    exit logits in depth order followed by the final head's logits (when the head is kept).
    """

    def __init__(
        self,
        stem: nn.Module,
        blocks: list[nn.Module],
        exits: dict[int, nn.Module],
        head: nn.Module | None,
        infos: tuple[BlockInfo, ...],
        arch: str,
    ) -> None:
        super().__init__()
        self.stem = stem
        self.blocks = nn.ModuleList(blocks)
        self.exits = nn.ModuleDict({str(k): v for k, v in sorted(exits.items())})
        self.head = head
        self.infos = infos
        self.arch = arch

    @property
    def num_outputs(self) -> int:
        return len(self.exits) + (1 if self.head is not None else 0)

    def forward_all(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every output (exits in depth order, then the head), always as a list."""
        x = self.stem(x)
        outputs: list[torch.Tensor] = []
        for index, block in enumerate(self.blocks):
            x = block(x)
            key = str(index)
            if key in self.exits:
                outputs.append(self.exits[key](x))
        if self.head is not None:
            outputs.append(self.head(x))
        return outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        outputs = self.forward_all(x)
        return outputs[0] if len(outputs) == 1 else outputs

    def features(self, x: torch.Tensor, upto: int | None = None) -> torch.Tensor:
        """Stem plus blocks [0, upto) — used by depth-wise training and the profiler."""
        x = self.stem(x)
        for block in list(self.blocks)[:upto]:
            x = block(x)
        return x
