"""Channel alignment: zero-pad every feature map of a folded conv graph to a multiple of the CPU's SIMD block.

ONNX Runtime's blocked (NCHWc) convolutions run a channel count that is not a multiple of the
block as badly as the next multiple, or worse: NeFL-WD's smallest ResNet-20 (11/22/43 channels)
ran at 0.74 of the full model's latency although it needs 0.31 of its MACs. Padding its maps with
zero channels restores the expected speed-up and changes no output: a padded channel is zero after
every convolution (zero weights, zero bias), stays zero through ReLU, pooling, residual additions
and per-channel affines (zero shift), is multiplied by a gate (DepthFL) and is ignored by the
classifier (zero columns). The image input is never padded. Conv graphs only (not ViT: LayerNorm
would see the extra features).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from nestling.errors import SpecError
from nestling.export.fold import ChannelAffine, conv_like
from nestling.export.standalone import StandaloneNet


def aligned(channels: int, multiple: int) -> int:
    return int(math.ceil(channels / multiple) * multiple)


def _pad_conv(conv: nn.Conv2d, multiple: int, *, pad_input: bool) -> nn.Conv2d:
    depthwise = conv.groups > 1
    if conv.groups > 1 and not conv.groups == conv.in_channels == conv.out_channels:
        raise SpecError("channel alignment supports dense and depthwise convolutions only")
    n_out = aligned(conv.out_channels, multiple)
    n_in = n_out if depthwise else (aligned(conv.in_channels, multiple) if pad_input else conv.in_channels)
    out = conv_like(conv, n_in, n_out, groups=n_out if depthwise else 1, bias=conv.bias is not None)
    with torch.no_grad():
        out.weight.zero_()
        out.weight[: conv.out_channels, : conv.weight.shape[1]].copy_(conv.weight)
        if conv.bias is not None and out.bias is not None:
            out.bias.zero_()
            out.bias[: conv.out_channels].copy_(conv.bias)
    return out


def _pad_linear(linear: nn.Linear, multiple: int) -> nn.Linear:
    out = nn.Linear(aligned(linear.in_features, multiple), linear.out_features, bias=linear.bias is not None)
    with torch.no_grad():
        out.weight.zero_()
        out.weight[:, : linear.in_features].copy_(linear.weight)
        if linear.bias is not None and out.bias is not None:
            out.bias.copy_(linear.bias)
    return out


def _pad_affine(affine: ChannelAffine, multiple: int) -> ChannelAffine:
    n = affine.scale.shape[1]
    scale = torch.zeros(aligned(n, multiple), dtype=torch.float64)
    shift = torch.zeros(aligned(n, multiple), dtype=torch.float64)
    scale[:n] = affine.scale.flatten().double()
    shift[:n] = affine.shift.flatten().double()
    return ChannelAffine((scale, shift))


def alignable(model: StandaloneNet) -> bool:
    """Only convolutional graphs (a conv stem to start from): a LayerNorm would normalise over the padded
    features too, and a graph without convolutions has no feature maps to pad."""
    has_conv_stem = any(isinstance(m, nn.Conv2d) for m in model.stem.modules())
    return has_conv_stem and not any(isinstance(m, nn.LayerNorm) for m in model.modules())


def align_channels(model: StandaloneNet, multiple: int) -> StandaloneNet:
    """Pad `model`'s feature maps in place to a multiple of `multiple` channels; returns it for chaining."""
    if multiple < 2:
        return model
    if not alignable(model):
        raise SpecError("channel alignment applies to convolutional models only")
    first = next(m for m in model.stem.modules() if isinstance(m, nn.Conv2d))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Conv2d):
                setattr(parent, name, _pad_conv(child, multiple, pad_input=child is not first))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, _pad_linear(child, multiple))
            elif isinstance(child, ChannelAffine):
                setattr(parent, name, _pad_affine(child, multiple))
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model.eval()
