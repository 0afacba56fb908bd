"""The DBB fusion transforms (METHODS §5.a.2): every branch of a Diverse Branch Block as one K×K conv + bias.

Each function returns an equivalent (kernel, bias) pair in eval mode (BatchNorm with its running
statistics). Kernels use PyTorch's grouped layout `[C_out, C_in/groups, kh, kw]`; biases are `[C_out]`.
The numbering follows the DBB paper (transforms I–VI) and DyRep (IX, identity as a conv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KernelBias = tuple[torch.Tensor, torch.Tensor]


def bn_scale_shift(bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval-mode BN as y·scale + shift per channel: scale = γ/σ, shift = β − μ·γ/σ, σ = √(running_var + ε)."""
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError(f"{type(bn).__name__} keeps no running statistics, so it has no eval-mode conv form")
    std = torch.sqrt(bn.running_var + bn.eps)
    gamma = bn.weight if bn.weight is not None else torch.ones_like(std)
    beta = bn.bias if bn.bias is not None else torch.zeros_like(std)
    scale = gamma / std
    return scale, beta - bn.running_mean * scale


def fuse_conv_bn(kernel: torch.Tensor, bias: torch.Tensor | None, bn: nn.BatchNorm2d) -> KernelBias:
    """(I) conv followed by BN: W' = W·γ/σ per output channel, b' = β + (b − μ)·γ/σ."""
    scale, shift = bn_scale_shift(bn)
    fused_bias = shift if bias is None else shift + bias * scale
    return kernel * scale.reshape(-1, 1, 1, 1), fused_bias


def bn_zero_response(bn: nn.BatchNorm2d, prev_bias: torch.Tensor | None) -> torch.Tensor:
    """What an eval-mode BN outputs for a pixel whose pre-BN value is the preceding conv's bias (0 if none).

    This is the constant a BN-and-pad layer must pad with, β + γ·(b_prev − μ)/σ (METHODS §5.a.1): a
    zero pixel of the block's input becomes exactly this value after the 1×1 conv and its BN, so the
    sequential branch equals one K×K conv over the zero-padded input.
    """
    scale, shift = bn_scale_shift(bn)
    return shift if prev_bias is None else shift + prev_bias * scale


def add_branches(pairs: list[KernelBias]) -> KernelBias:
    """(II) parallel branches with aligned padding: kernels add, biases add."""
    if not pairs:
        raise ValueError("add_branches needs at least one (kernel, bias) pair")
    kernel = torch.stack([k for k, _ in pairs]).sum(0)
    bias = torch.stack([b for _, b in pairs]).sum(0)
    return kernel, bias


def fuse_1x1_kxk(first: KernelBias, second: KernelBias, groups: int) -> KernelBias:
    """(III + IV) a 1×1 conv (F1 ∈ R^{D×C/g}, b1) followed by a K×K conv (F2 ∈ R^{E×D/g×K×K}, b2).

    Per group: F[e, c] = Σ_d F2[e, d]·F1[d, c], b[e] = b2[e] + Σ_{d,h,w} F2[e, d, h, w]·b1[d]; the
    per-group results are concatenated along the output axis (IV). Exact only if the K×K conv's input
    was padded with the 1×1 branch's zero response (see `bn_zero_response`), never with zeros.
    """
    k1, b1 = first
    k2, b2 = second
    if k1.shape[2:] != (1, 1):
        raise ValueError(f"the first conv of transform III must be 1×1, got a {tuple(k1.shape[2:])} kernel")
    inner, out = k1.shape[0], k2.shape[0]
    if inner % groups or out % groups or k2.shape[1] * groups != inner:
        raise ValueError(
            f"transform III: inner width {inner}, output {out} and the K×K conv's {k2.shape[1]} inputs per group "
            f"do not fit {groups} groups"
        )
    inner_g, out_g = inner // groups, out // groups
    kernels, biases = [], []
    for g in range(groups):
        f1 = k1[g * inner_g : (g + 1) * inner_g, :, 0, 0]  # [D/g, C/g]
        f2 = k2[g * out_g : (g + 1) * out_g]  # [E/g, D/g, K, K]
        kernels.append(torch.einsum("edhw,dc->echw", f2, f1))
        biases.append(torch.einsum("edhw,d->e", f2, b1[g * inner_g : (g + 1) * inner_g]))
    return torch.cat(kernels, 0), b2 + torch.cat(biases, 0)


def avg_pool_kernel(channels: int, kernel_size: int, groups: int, *, like: torch.Tensor) -> torch.Tensor:
    """(V) K×K average pooling over `channels` as a grouped conv: F[c, c mod (C/g)] = 1/K², zero elsewhere."""
    if channels % groups:
        raise ValueError(f"{channels} channels do not split into {groups} groups")
    per_group = channels // groups
    kernel = torch.zeros(channels, per_group, kernel_size, kernel_size, dtype=like.dtype, device=like.device)
    index = torch.arange(channels, device=like.device)
    kernel[index, index % per_group] = 1.0 / kernel_size**2
    return kernel


def pad_to_square(kernel: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """(VI) a 1×1, 1×K or K×1 kernel zero-padded symmetrically to K×K (centres stay aligned)."""
    kh, kw = kernel.shape[2:]
    if (kernel_size - kh) % 2 or (kernel_size - kw) % 2 or kh > kernel_size or kw > kernel_size:
        raise ValueError(f"a {kh}×{kw} kernel cannot be centred in a {kernel_size}×{kernel_size} one")
    pad_h, pad_w = (kernel_size - kh) // 2, (kernel_size - kw) // 2
    return F.pad(kernel, [pad_w, pad_w, pad_h, pad_h])


def identity_kernel(
    channels: int, in_per_group: int, kernel_size: int, *, like: torch.Tensor
) -> torch.Tensor:
    """(IX, DyRep) the identity as a K×K grouped conv: 1 at the centre of [i, i mod (C/g)]."""
    kernel = torch.zeros(
        channels, in_per_group, kernel_size, kernel_size, dtype=like.dtype, device=like.device
    )
    index = torch.arange(channels, device=like.device)
    centre = kernel_size // 2
    kernel[index, index % in_per_group, centre, centre] = 1.0
    return kernel
