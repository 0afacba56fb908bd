"""The 7-branch Diverse Branch Block of DynamicFL / DyRep (METHODS §5.a.1) and its exact fusion (§5.a.2).

A `DiverseBranchBlock` stands in for one K×K convolution (the BN that follows the conv stays outside).
Its branches, in canonical order:

* ``conv1x1``      1×1 conv (stride s) → BN
* ``conv1x1_kxk``  1×1 conv (C_in → D) → BN-and-pad → K×K conv (stride s, no padding) → BN
* ``conv1x1_avg``  1×1 conv (C_in → C_out) → BN-and-pad → K×K average pool (stride s) → BN
                   (groups ≥ C_out: K×K average pool with the conv's padding directly → BN)
* ``kxk``          the original K×K conv, with a bias → BN (always present; carries the plain weights)
* ``conv1xk``      1×K conv, padding (0, p) → BN
* ``convkx1``      K×1 conv, padding (p, 0) → BN
* ``identity``     BN(x), only when C_in = C_out and stride 1

The branches that need the kernel centres aligned (1×1, 1×K, K×1, identity) exist only when K is odd and
the conv's padding is K//2. `DiverseBranchBlock.equivalent()` is the one K×K conv + bias the block
equals in eval mode; it is exact because BN-and-pad pads with the BN's zero response, not with zeros.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nestling.methods.dynamicfl.transforms import (
    KernelBias,
    add_branches,
    avg_pool_kernel,
    fuse_1x1_kxk,
    fuse_conv_bn,
    identity_kernel,
    pad_to_square,
)

ORIGINAL = "kxk"
BRANCHES: tuple[str, ...] = (
    "conv1x1",
    "conv1x1_kxk",
    "conv1x1_avg",
    ORIGINAL,
    "conv1xk",
    "convkx1",
    "identity",
)
DBB4_BRANCHES: tuple[str, ...] = (
    "conv1x1",
    "conv1x1_kxk",
    "conv1x1_avg",
    ORIGINAL,
)  # Ding et al. 2021 (§7.5)


@dataclass(frozen=True)
class ConvGeometry:
    """What a DBB must reproduce of the conv it replaces: channels, square kernel, stride, padding, groups."""

    in_channels: int
    out_channels: int
    kernel_size: int
    stride: int = 1
    padding: int = 0
    groups: int = 1

    def __post_init__(self) -> None:
        if self.kernel_size < 2:
            raise ValueError(
                f"a Diverse Branch Block replaces a K×K conv with K >= 2, got K = {self.kernel_size}"
            )
        if self.stride < 1 or self.padding < 0 or self.groups < 1:
            raise ValueError(
                f"bad conv geometry: stride {self.stride}, padding {self.padding}, groups {self.groups}"
            )
        if self.in_channels % self.groups or self.out_channels % self.groups:
            raise ValueError(
                f"{self.in_channels}→{self.out_channels} channels do not split into {self.groups} groups"
            )

    @classmethod
    def of(cls, conv: nn.Conv2d) -> ConvGeometry:
        """The geometry of a plain conv, refusing what a DBB cannot stand in for."""
        kh, kw = conv.kernel_size
        sh, sw = conv.stride
        if kh != kw:
            raise ValueError(f"only square kernels expand into a DBB, got {kh}×{kw}")
        if sh != sw:
            raise ValueError(f"only equal strides expand into a DBB, got {conv.stride}")
        if tuple(conv.dilation) != (1, 1):
            raise ValueError(f"dilated convs do not expand into a DBB (dilation {conv.dilation})")
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ValueError(
                f"only explicit zero padding expands into a DBB, got {conv.padding!r} / {conv.padding_mode}"
            )
        ph, pw = conv.padding
        if ph != pw:
            raise ValueError(f"only symmetric padding expands into a DBB, got {conv.padding}")
        return cls(conv.in_channels, conv.out_channels, kh, sh, ph, conv.groups)

    @property
    def centred(self) -> bool:
        """Whether kernel centres of 1×1 / 1×K / K×1 / identity branches align with the K×K conv's."""
        return self.kernel_size % 2 == 1 and self.padding == self.kernel_size // 2

    @property
    def direct_average(self) -> bool:
        """Whether the average branch pools the input directly (groups ≥ C_out, as the DBB paper does)."""
        return self.groups >= self.out_channels

    def available_branches(self) -> tuple[str, ...]:
        """The branches this geometry supports, in canonical order."""
        names: list[str] = []
        for name in BRANCHES:
            if name in ("conv1x1", "conv1xk", "convkx1") and not self.centred:
                continue
            if name == "identity" and not (
                self.centred and self.stride == 1 and self.in_channels == self.out_channels
            ):
                continue
            if (
                name == "conv1x1_avg"
                and self.direct_average
                and (self.in_channels != self.out_channels or self.padding > self.kernel_size // 2)
            ):
                continue
            names.append(name)
        return tuple(names)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        k, s, p = self.kernel_size, self.stride, self.padding
        return (height + 2 * p - k) // s + 1, (width + 2 * p - k) // s + 1


def pad_with_border(x: torch.Tensor, border: torch.Tensor, pixels: int) -> torch.Tensor:
    """Pad `pixels` on every side with a per-channel constant instead of zeros (BN-and-pad, METHODS §5.a.1)."""
    if pixels == 0:
        return x
    padded = F.pad(x, [pixels] * 4)
    height, width = padded.shape[2:]
    inside = torch.zeros(1, 1, height, width, dtype=torch.bool, device=x.device)
    inside[:, :, pixels : height - pixels, pixels : width - pixels] = True
    return torch.where(inside, padded, border.reshape(1, -1, 1, 1).to(padded.dtype))


class ConvBNBranch(nn.Module):
    """One conv (K×K, 1×1, 1×K or K×1, aligned on the K×K conv's centre) followed by a BN."""

    def __init__(self, geometry: ConvGeometry, kernel: tuple[int, int], *, bias: bool) -> None:
        super().__init__()
        self.kernel_size = geometry.kernel_size
        if kernel == (geometry.kernel_size, geometry.kernel_size):
            padding = (geometry.padding, geometry.padding)
        else:  # 1×1, 1×K, K×1 (centred geometry only): padded by K//2 along each long side
            half = geometry.kernel_size // 2
            padding = (half if kernel[0] > 1 else 0, half if kernel[1] > 1 else 0)
        self.conv = nn.Conv2d(
            geometry.in_channels,
            geometry.out_channels,
            kernel,
            geometry.stride,
            padding,
            groups=geometry.groups,
            bias=bias,
        )
        self.bn = nn.BatchNorm2d(geometry.out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn

    def equivalent(self) -> KernelBias:
        kernel, bias = fuse_conv_bn(self.conv.weight, self.conv.bias, self.bn)
        return pad_to_square(kernel, self.kernel_size), bias


class SequentialBranch(nn.Module):
    """1×1 conv → BN-and-pad → (K×K conv | K×K average pool) → BN, the DBB's two sequential branches.

    The border of the padded tensor is the BN's response to a zero input pixel (`border_value`): in eval
    mode from the running statistics, which makes the fusion exact (transform III); in train mode from the
    batch statistics the BN just normalised with, so the border is what the same BN gives a zero pixel.
    """

    def __init__(self, geometry: ConvGeometry, inner: int, *, pool: bool) -> None:
        super().__init__()
        g = geometry
        if inner % g.groups:
            raise ValueError(f"inner width {inner} does not split into {g.groups} groups")
        self.kernel_size, self.stride, self.padding, self.groups = (
            g.kernel_size,
            g.stride,
            g.padding,
            g.groups,
        )
        self.conv1 = nn.Conv2d(g.in_channels, inner, 1, groups=g.groups, bias=False)
        self.bn1 = nn.BatchNorm2d(inner)
        self.pool = pool
        self.conv2: nn.Conv2d | None = None
        if not pool:
            self.conv2 = nn.Conv2d(
                inner, g.out_channels, g.kernel_size, g.stride, 0, groups=g.groups, bias=False
            )
        self.bn2 = nn.BatchNorm2d(g.out_channels)

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def border_value(self, pre: torch.Tensor) -> torch.Tensor:
        """β + γ·(b_prev − μ)/σ: the value a zero input pixel has after conv1 and bn1."""
        bn, prev_bias = self.bn1, self.conv1.bias
        if bn.training or bn.running_mean is None or bn.running_var is None:
            var, mean = torch.var_mean(pre, dim=(0, 2, 3), correction=0)
        else:
            var, mean = bn.running_var, bn.running_mean
        scale = bn.weight / torch.sqrt(var + bn.eps)
        zero_pixel = torch.zeros_like(mean) if prev_bias is None else prev_bias
        return bn.bias + (zero_pixel - mean) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.conv1(x)
        h = self.bn1(pre)
        if self.padding:
            h = pad_with_border(h, self.border_value(pre), self.padding)
        if self.conv2 is not None:
            h = self.conv2(h)
        else:
            h = F.avg_pool2d(h, self.kernel_size, self.stride, 0)
        return self.bn2(h)

    def equivalent(self) -> KernelBias:
        first = fuse_conv_bn(self.conv1.weight, self.conv1.bias, self.bn1)
        if self.conv2 is not None:
            second_kernel = self.conv2.weight
        else:
            second_kernel = avg_pool_kernel(
                self.bn2.num_features, self.kernel_size, self.groups, like=first[0]
            )
        zeros = torch.zeros(second_kernel.shape[0], dtype=first[0].dtype, device=first[0].device)
        kernel, bias = fuse_1x1_kxk(first, (second_kernel, zeros), self.groups)
        return fuse_conv_bn(kernel, bias, self.bn2)


class AveragePoolBranch(nn.Module):
    """K×K average pool with the conv's padding → BN (the average branch when groups ≥ C_out)."""

    def __init__(self, geometry: ConvGeometry) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding, self.groups = (
            geometry.kernel_size,
            geometry.stride,
            geometry.padding,
            geometry.groups,
        )
        self.bn = nn.BatchNorm2d(geometry.out_channels)

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(F.avg_pool2d(x, self.kernel_size, self.stride, self.padding, count_include_pad=True))

    def equivalent(self) -> KernelBias:
        kernel = avg_pool_kernel(self.bn.num_features, self.kernel_size, self.groups, like=self.bn.weight)
        return fuse_conv_bn(kernel, None, self.bn)


class IdentityBranch(nn.Module):
    """BN(x): the identity branch (transform IX)."""

    def __init__(self, geometry: ConvGeometry) -> None:
        super().__init__()
        self.kernel_size = geometry.kernel_size
        self.in_per_group = geometry.in_channels // geometry.groups
        self.bn = nn.BatchNorm2d(geometry.out_channels)

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x)

    def equivalent(self) -> KernelBias:
        kernel = identity_kernel(
            self.bn.num_features, self.in_per_group, self.kernel_size, like=self.bn.weight
        )
        return fuse_conv_bn(kernel, None, self.bn)


Branch = ConvBNBranch | SequentialBranch | AveragePoolBranch | IdentityBranch


def make_branch(name: str, geometry: ConvGeometry, inner_width: int) -> Branch:
    """Build one named branch for `geometry` (the caller has checked it is available)."""
    k = geometry.kernel_size
    if name == ORIGINAL:
        return ConvBNBranch(geometry, (k, k), bias=True)
    if name == "conv1x1":
        return ConvBNBranch(geometry, (1, 1), bias=False)
    if name == "conv1xk":
        return ConvBNBranch(geometry, (1, k), bias=False)
    if name == "convkx1":
        return ConvBNBranch(geometry, (k, 1), bias=False)
    if name == "conv1x1_kxk":
        return SequentialBranch(geometry, inner_width, pool=False)
    if name == "conv1x1_avg":
        if geometry.direct_average:
            return AveragePoolBranch(geometry)
        return SequentialBranch(geometry, geometry.out_channels, pool=True)
    if name == "identity":
        return IdentityBranch(geometry)
    raise ValueError(f"unknown DBB branch '{name}' (known: {', '.join(BRANCHES)})")


def checked_branches(geometry: ConvGeometry, branches: Iterable[str] | None) -> tuple[str, ...]:
    """`branches` in canonical order with the original K×K one; every branch available for `geometry`."""
    available = geometry.available_branches()
    if branches is None:
        return available
    wanted = set(branches) | {ORIGINAL}
    unknown = sorted(wanted - set(BRANCHES))
    if unknown:
        raise ValueError(f"unknown DBB branches {unknown} (known: {', '.join(BRANCHES)})")
    missing = sorted(wanted - set(available))
    if missing:
        raise ValueError(
            f"branches {missing} are not available for {geometry} (available: {', '.join(available)})"
        )
    return tuple(name for name in BRANCHES if name in wanted)


class DiverseBranchBlock(nn.Module):
    """A K×K conv re-parameterised as parallel branches; `equivalent()` folds it back (eval mode)."""

    plain_template: (
        nn.Conv2d | None
    )  # kept out of the module tree: not a parameter holder, not in the state dict

    def __init__(
        self, geometry: ConvGeometry, branches: Iterable[str] | None = None, *, inner_width: int | None = None
    ) -> None:
        super().__init__()
        self.geometry = geometry
        self.inner_width = geometry.in_channels if inner_width is None else int(inner_width)
        if self.inner_width < 1:
            raise ValueError(f"inner width must be positive, got {self.inner_width}")
        self.branches = nn.ModuleDict(
            {
                name: make_branch(name, geometry, self.inner_width)
                for name in checked_branches(geometry, branches)
            }
        )
        self.site: Any = None  # set by sites.expand_model: the ConvSite this block stands in for
        object.__setattr__(
            self, "plain_template", None
        )  # the replaced conv on the meta device (not a submodule)

    @property
    def branch_names(self) -> tuple[str, ...]:
        return tuple(self.branches.keys())

    def branch(self, name: str) -> Branch:
        if name not in self.branches:
            raise KeyError(f"this DBB has no '{name}' branch (it has: {', '.join(self.branch_names)})")
        return self.branches[name]  # type: ignore[return-value]

    @property
    def original(self) -> ConvBNBranch:
        return self.branches[ORIGINAL]  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor | None = None
        for branch in self.branches.values():
            y = branch(x)
            out = y if out is None else out + y
        assert out is not None
        return out

    def branch_equivalents(self, names: Sequence[str] | None = None) -> dict[str, KernelBias]:
        """Each branch's eval-mode (kernel, bias) as one K×K conv."""
        chosen = self.branch_names if names is None else tuple(names)
        return {name: self.branch(name).equivalent() for name in chosen}

    def equivalent(self) -> KernelBias:
        """The one K×K conv + bias this block equals in eval mode (sum over branches, transform II)."""
        with torch.no_grad():
            return add_branches(list(self.branch_equivalents().values()))

    def extra_repr(self) -> str:
        g = self.geometry
        return (
            f"{g.in_channels}→{g.out_channels}, K={g.kernel_size}, stride={g.stride}, padding={g.padding}, "
            f"groups={g.groups}, inner={self.inner_width}, branches={list(self.branch_names)}"
        )
