"""The plain torch modules a standalone graph is made of (every constant already folded in)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nestling.export.fold import plain_linear
from nestling.models.blocks import EncoderBlock
from nestling.models.heads import TokenClassifier


class Residual(nn.Module):
    """Post-activation residual: ReLU(body(x) + shortcut(x)) (step size already inside body)."""

    def __init__(self, body: nn.Module, shortcut: nn.Module | None) -> None:
        super().__init__()
        self.body = body
        self.shortcut = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.shortcut(x) if self.shortcut is not None else x
        return F.relu(self.body(x) + skip)


class PreActResidual(nn.Module):
    """Pre-activation residual: h = ReLU(a·x + b); body(h) + (projection(h) or x)."""

    def __init__(self, pre: nn.Module, body: nn.Module, shortcut: nn.Module | None) -> None:
        super().__init__()
        self.pre = pre
        self.body = body
        self.shortcut = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        skip = self.shortcut(h) if self.shortcut is not None else x
        return self.body(h) + skip


class PoolLinear(nn.Module):
    """pre → global average pool → linear: every conv classifier head."""

    def __init__(self, pre: nn.Module, fc: nn.Linear) -> None:
        super().__init__()
        self.pre = pre
        self.fc = fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.pre(x), 1), 1))


class GatedPoolLinear(nn.Module):
    """DepthFL exit: sigmoid gate (cropped to the input's size) × x → SepConv stack → pool → linear."""

    def __init__(self, attention: nn.Module, stack: nn.Module, fc: nn.Linear) -> None:
        super().__init__()
        self.attention = attention
        self.stack = stack
        self.fc = fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.attention(x)[..., : x.shape[-2], : x.shape[-1]]
        feature = self.stack(gate * x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(feature, 1), 1))


class PatchEmbed(nn.Module):
    """ViT stem: patch projection, class token, learned positions."""

    def __init__(self, proj: nn.Conv2d, cls_token: torch.Tensor, pos_embed: torch.Tensor) -> None:
        super().__init__()
        self.proj = proj
        self.cls_token = nn.Parameter(cls_token.detach().clone(), requires_grad=False)
        self.pos_embed = nn.Parameter(pos_embed.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.pos_embed


class Encoder(nn.Module):
    """ViT encoder block with both step sizes folded into the output projections."""

    def __init__(self, block: EncoderBlock) -> None:
        super().__init__()
        self.head_dim = block.head_dim
        self.ln1, self.ln2 = _layer_norm(block.ln1), _layer_norm(block.ln2)
        self.q, self.k, self.v = (plain_linear(t) for t in (block.q, block.k, block.v))
        self.proj = plain_linear(block.proj, scale=block.step_sa.detach().double())
        self.fc1 = plain_linear(block.fc1)
        self.fc2 = plain_linear(block.fc2, scale=block.step_ffn.detach().double())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        h = self.ln1(x)
        q, k, v = (
            t(h).view(batch, tokens, -1, self.head_dim).transpose(1, 2) for t in (self.q, self.k, self.v)
        )
        attn = torch.softmax(q @ k.transpose(-2, -1) * self.head_dim**-0.5, dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, tokens, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TokenHead(nn.Module):
    """ViT head: LayerNorm → class token → linear."""

    def __init__(self, head: TokenClassifier) -> None:
        super().__init__()
        self.norm = _layer_norm(head.norm)
        self.fc = plain_linear(head.fc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x)[:, 0])


def _layer_norm(norm: nn.LayerNorm) -> nn.LayerNorm:
    out = nn.LayerNorm(norm.normalized_shape, eps=norm.eps)
    out.load_state_dict(norm.state_dict())
    return out
