"""Residual blocks with learnable step sizes (NeFL `x + s·f(x)`, METHODS §1.5, §2.a.3).

A block built with `skipped=True` holds only what its skip path needs (the projection shortcut of a
stage's first block) and never runs its residual branch: numerically the same as s = 0, without the
compute, and without a step-size parameter (s is fixed at 0 for skipped blocks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nestling.models.context import BuildContext
from nestling.models.roles import STEP, declare_role


def _step(initial: float, learnable: bool) -> nn.Parameter:
    return nn.Parameter(torch.full((1,), float(initial)), requires_grad=learnable)


class BasicBlock(nn.Module):
    """Post-activation block: y = ReLU(s·BN2(conv2(ReLU(BN1(conv1 x)))) + P(x)); option-B projection."""

    def __init__(
        self,
        ctx: BuildContext,
        global_in: int,
        global_out: int,
        stride: int,
        *,
        skipped: bool,
        hidden_ratio: float | None = None,
        global_hidden: int | None = None,
    ) -> None:
        super().__init__()
        hidden = global_out if global_hidden is None else global_hidden  # a grown layout's internal width
        self.skipped = skipped
        self.has_projection = stride != 1 or global_in != global_out
        if self.has_projection:
            self.shortcut = nn.Sequential(
                ctx.conv(global_in, global_out, 1, stride=stride), ctx.scaler(), ctx.norm(global_out)
            )
        if skipped:
            return
        self.conv1 = ctx.conv(global_in, hidden, 3, stride=stride, out_ratio=hidden_ratio)
        self.scale1 = ctx.scaler()
        self.bn1 = ctx.norm(hidden, hidden_ratio)
        self.conv2 = ctx.conv(hidden, global_out, 3, in_ratio=hidden_ratio)
        self.scale2 = ctx.scaler()
        self.bn2 = ctx.norm(global_out)
        self.step = _step(1.0, ctx.model.learnable_step)
        declare_role(self, STEP, "step")

    def stepped_channels(self) -> int:
        """Channels the step size multiplies (grouped training broadcasts each client's step over them)."""
        return self.conv2.out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.shortcut(x) if self.has_projection else x
        if self.skipped:
            return F.relu(skip)
        out = F.relu(self.bn1(self.scale1(self.conv1(x))))
        out = self.bn2(self.scale2(self.conv2(out)))
        return F.relu(self.step * out + skip)


class PreActBlock(nn.Module):
    """Pre-activation block (FeDepth PreResNet-20, HeteroFL): h = ReLU(BN1 x); y = s·conv2(ReLU(BN2 conv1 h)) + P(h).

    Identity shortcuts add x, not h (METHODS §1.5 DECISION, AMBIG-9); projections act on h.
    """

    def __init__(
        self,
        ctx: BuildContext,
        global_in: int,
        global_out: int,
        stride: int,
        *,
        skipped: bool,
        hidden_ratio: float | None = None,
        global_hidden: int | None = None,
    ) -> None:
        super().__init__()
        hidden = global_out if global_hidden is None else global_hidden  # a grown layout's internal width
        self.skipped = skipped
        self.has_projection = stride != 1 or global_in != global_out
        if self.has_projection or not skipped:
            self.scale1 = ctx.scaler()  # HeteroFL: a Scaler in front of every normalisation layer
            self.bn1 = ctx.norm(global_in)
        if self.has_projection:
            # No Scaler here: the projection's output meets no norm, so a train-only ×1/r would make training
            # and evaluation different networks. (Index 0 keeps the state-dict key `shortcut.1.weight`.)
            self.shortcut = nn.Sequential(nn.Identity(), ctx.conv(global_in, global_out, 1, stride=stride))
        if skipped:
            return
        self.conv1 = ctx.conv(global_in, hidden, 3, stride=stride, out_ratio=hidden_ratio)
        self.scale2 = ctx.scaler()
        self.bn2 = ctx.norm(hidden, hidden_ratio)
        self.conv2 = ctx.conv(hidden, global_out, 3, in_ratio=hidden_ratio)
        self.step = _step(1.0, ctx.model.learnable_step)
        declare_role(self, STEP, "step")

    def stepped_channels(self) -> int:
        """Channels the step size multiplies (grouped training broadcasts each client's step over them)."""
        return self.conv2.out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skipped and not self.has_projection:
            return x
        h = F.relu(self.bn1(self.scale1(x)))
        skip = self.shortcut(h) if self.has_projection else x
        if self.skipped:
            return skip
        out = self.conv1(h)
        out = self.conv2(F.relu(self.bn2(self.scale2(out))))
        return self.step * out + skip


class EncoderBlock(nn.Module):
    """ViT encoder block with two step sizes: x += s_sa·SA(LN1 x); x += s_ffn·FFN(LN2 x) (METHODS §2.a.3).

    Width slicing keeps the first heads (head_dim fixed) and the first MLP units; q, k and v are
    separate projections so that a prefix of each stays a valid set of heads.
    """

    def __init__(
        self,
        ctx: BuildContext,
        dim: int,
        heads: int,
        mlp_dim: int,
        *,
        skipped: bool,
        hidden_ratio: float | None = None,
    ) -> None:
        super().__init__()
        self.skipped = skipped
        if skipped:
            return
        self.head_dim = dim // heads
        ratio = ctx.width if hidden_ratio is None else hidden_ratio
        self.heads = ctx.channels(heads, ratio)
        inner = self.heads * self.head_dim
        self.ln1 = ctx.layer_norm(dim)
        self.q = ctx.linear(dim, dim, slim_out=True, out_ratio=inner / dim)
        self.k = ctx.linear(dim, dim, slim_out=True, out_ratio=inner / dim)
        self.v = ctx.linear(dim, dim, slim_out=True, out_ratio=inner / dim)
        self.proj = ctx.linear(dim, dim, slim_out=True, in_ratio=inner / dim)
        self.ln2 = ctx.layer_norm(dim)
        self.fc1 = ctx.linear(dim, mlp_dim, slim_out=True, out_ratio=ratio)
        self.fc2 = ctx.linear(mlp_dim, dim, slim_out=True, in_ratio=ratio)
        self.step_sa = _step(1.0, ctx.model.learnable_step)
        self.step_ffn = _step(1.0, ctx.model.learnable_step)
        declare_role(self, STEP, "step_sa", "step_ffn")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skipped:
            return x
        batch, tokens, _ = x.shape
        h = self.ln1(x)
        q, k, v = (
            t(h).view(batch, tokens, -1, self.head_dim).transpose(1, 2) for t in (self.q, self.k, self.v)
        )
        attn = F.scaled_dot_product_attention(q, k, v)
        attn = attn.transpose(1, 2).reshape(batch, tokens, -1)
        x = x + self.step_sa * self.proj(attn)
        x = x + self.step_ffn * self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x
