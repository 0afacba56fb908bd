"""Each fusion transform on its own (METHODS §5.b.2), and the zero-padding pitfall (§5.b.3, §10.8)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nestling.methods.dynamicfl.dbb import (
    AveragePoolBranch,
    ConvBNBranch,
    ConvGeometry,
    IdentityBranch,
    SequentialBranch,
    pad_with_border,
)
from nestling.methods.dynamicfl.transforms import (
    avg_pool_kernel,
    bn_zero_response,
    fuse_1x1_kxk,
    fuse_conv_bn,
    identity_kernel,
    pad_to_square,
)
from tests.methods.dynamicfl.reparam_helpers import randomise_norms

TOL = 1e-5


def _x(channels: int, side: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randn(
        2, channels, side, side, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )


def _fused_output(branch: nn.Module, x: torch.Tensor, geometry: ConvGeometry) -> torch.Tensor:
    kernel, bias = branch.equivalent()  # type: ignore[operator]
    return F.conv2d(x, kernel, bias, geometry.stride, geometry.padding, 1, geometry.groups)


def _prepared(branch: nn.Module, seed: int = 3) -> nn.Module:
    branch = branch.double()
    randomise_norms(branch, torch.Generator().manual_seed(seed))
    return branch.eval()


@pytest.mark.parametrize("groups", [1, 2])
def test_conv_bn_fusion_transform_I(groups: int) -> None:
    conv = nn.Conv2d(8, 6, 3, 2, 1, groups=groups, bias=True).double()
    bn = _prepared(nn.BatchNorm2d(6))
    x = _x(8)
    kernel, bias = fuse_conv_bn(conv.weight, conv.bias, bn)  # type: ignore[arg-type]
    expected = bn(conv(x))
    assert (F.conv2d(x, kernel, bias, 2, 1, 1, groups) - expected).abs().max() <= TOL


@pytest.mark.parametrize(
    ("groups", "inner", "kernel_size", "stride"), [(1, 8, 3, 1), (2, 12, 3, 2), (2, 8, 5, 1)]
)
def test_one_by_one_then_kxk_transform_III_IV_pads_with_the_first_bias(
    groups: int, inner: int, kernel_size: int, stride: int
) -> None:
    generator = torch.Generator().manual_seed(1)
    k1 = torch.randn(inner, 8 // groups, 1, 1, generator=generator, dtype=torch.float64)
    b1 = torch.randn(inner, generator=generator, dtype=torch.float64)
    k2 = torch.randn(6, inner // groups, kernel_size, kernel_size, generator=generator, dtype=torch.float64)
    b2 = torch.randn(6, generator=generator, dtype=torch.float64)
    x, pad = _x(8), kernel_size // 2
    middle = pad_with_border(
        F.conv2d(x, k1, b1, groups=groups), b1, pad
    )  # a zero pixel becomes b1 after the 1×1
    expected = F.conv2d(middle, k2, b2, stride, 0, 1, groups)
    kernel, bias = fuse_1x1_kxk((k1, b1), (k2, b2), groups)
    assert (F.conv2d(x, kernel, bias, stride, pad, 1, groups) - expected).abs().max() <= TOL


@pytest.mark.parametrize("pool", [False, True])
@pytest.mark.parametrize("groups", [1, 2])
def test_sequential_branch_with_bn_and_pad_equals_its_fused_conv(pool: bool, groups: int) -> None:
    geometry = ConvGeometry(8, 8, 3, 2, 1, groups)
    branch = SequentialBranch(geometry, 8, pool=pool)
    branch.conv1 = nn.Conv2d(8, 8, 1, groups=groups, bias=True)  # a preceding bias: b_prev in the BN constant
    branch = _prepared(branch)
    x = _x(8)
    assert (branch(x) - _fused_output(branch, x, geometry)).abs().max() <= TOL


class ZeroPaddedBranch(SequentialBranch):
    """The pitfall: BN-and-pad padding with zeros instead of the BN's zero response."""

    def border_value(self, pre: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.bn1.num_features, dtype=pre.dtype)


@pytest.mark.parametrize("pool", [False, True])
def test_zero_padding_instead_of_the_bn_constant_breaks_the_fusion(pool: bool) -> None:
    geometry = ConvGeometry(8, 8, 3, 1, 1, 1)
    right, wrong = SequentialBranch(geometry, 8, pool=pool), ZeroPaddedBranch(geometry, 8, pool=pool)
    wrong.load_state_dict(right.state_dict())
    right, wrong = _prepared(right), _prepared(wrong)
    x = _x(8)
    assert (right(x) - _fused_output(right, x, geometry)).abs().max() <= TOL
    error = (wrong(x) - _fused_output(wrong, x, geometry)).abs().max()
    assert error > 1e-2, "zero padding must not pass the transform III check"
    interior = (wrong(x) - right(x))[:, :, 1:-1, 1:-1].abs().max()
    assert interior <= TOL, "only the border differs: exactly the pixels that see the padding"


def test_bn_zero_response_is_the_bn_output_of_the_preceding_bias() -> None:
    bn = _prepared(nn.BatchNorm2d(5))
    prev = torch.randn(5, dtype=torch.float64)
    expected = bn(prev.reshape(1, 5, 1, 1)).reshape(5)
    assert torch.allclose(bn_zero_response(bn, prev), expected, atol=1e-12)
    assert torch.allclose(
        bn_zero_response(bn, None), bn(torch.zeros(1, 5, 1, 1, dtype=torch.float64)).reshape(5)
    )


@pytest.mark.parametrize(("groups", "stride"), [(1, 1), (2, 2), (8, 1)])
def test_average_pool_as_a_conv_transform_V(groups: int, stride: int) -> None:
    x = _x(8)
    kernel = avg_pool_kernel(8, 3, groups, like=x)
    expected = F.avg_pool2d(x, 3, stride, 1)
    assert (F.conv2d(x, kernel, None, stride, 1, 1, groups) - expected).abs().max() <= TOL


def test_direct_average_branch_of_a_depthwise_conv_equals_its_fused_conv() -> None:
    geometry = ConvGeometry(8, 8, 3, 2, 1, 8)
    branch = _prepared(AveragePoolBranch(geometry))
    x = _x(8)
    assert (branch(x) - _fused_output(branch, x, geometry)).abs().max() <= TOL


@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (5, 1)])
def test_small_kernels_padded_to_kxk_transform_VI(shape: tuple[int, int]) -> None:
    geometry = ConvGeometry(8, 6, 5, 2, 2, 2)
    branch = _prepared(ConvBNBranch(geometry, shape, bias=False))
    x = _x(8)
    assert branch.equivalent()[0].shape == (6, 4, 5, 5)
    assert (branch(x) - _fused_output(branch, x, geometry)).abs().max() <= TOL


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_identity_as_a_conv_transform_IX(groups: int) -> None:
    x = _x(8)
    kernel = identity_kernel(8, 8 // groups, 3, like=x)
    assert torch.equal(F.conv2d(x, kernel, None, 1, 1, 1, groups), x)
    geometry = ConvGeometry(8, 8, 3, 1, 1, groups)
    branch = _prepared(IdentityBranch(geometry))
    assert (branch(x) - _fused_output(branch, x, geometry)).abs().max() <= TOL


def test_transforms_refuse_shapes_they_cannot_fuse() -> None:
    k = torch.zeros(4, 4, 3, 3)
    with pytest.raises(ValueError, match="must be 1×1"):
        fuse_1x1_kxk((k, torch.zeros(4)), (k, torch.zeros(4)), 1)
    with pytest.raises(ValueError, match="do not fit 2 groups"):
        fuse_1x1_kxk((torch.zeros(3, 4, 1, 1), torch.zeros(3)), (torch.zeros(4, 3, 3, 3), torch.zeros(4)), 2)
    with pytest.raises(ValueError, match="cannot be centred"):
        pad_to_square(torch.zeros(4, 4, 2, 2), 3)
    with pytest.raises(ValueError, match="no running statistics"):
        fuse_conv_bn(k, None, nn.BatchNorm2d(4, track_running_stats=False))
