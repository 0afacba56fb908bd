"""The whole Diverse Branch Block equals its one fused K×K conv in eval mode (METHODS §5.b.1, §7.5)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from nestling.methods.dynamicfl.dbb import BRANCHES, DBB4_BRANCHES, ConvGeometry, DiverseBranchBlock
from tests.methods.dynamicfl.reparam_helpers import randomise_norms

GRID = list(itertools.product([(32, 64), (32, 32)], [3, 5], [1, 2], [1, 2], [None, 48]))


def _block(
    geometry: ConvGeometry,
    branches: tuple[str, ...] | None,
    inner: int | None,
    dtype: torch.dtype,
    seed: int = 0,
) -> DiverseBranchBlock:
    torch.manual_seed(seed)
    block = DiverseBranchBlock(geometry, branches, inner_width=inner).to(dtype)
    randomise_norms(block, torch.Generator().manual_seed(seed + 1))
    return block.eval()


def _fusion_error(block: DiverseBranchBlock, x: torch.Tensor) -> float:
    g = block.geometry
    kernel, bias = block.equivalent()
    with torch.no_grad():
        return float((block(x) - F.conv2d(x, kernel, bias, g.stride, g.padding, 1, g.groups)).abs().max())


@pytest.mark.parametrize("variant", ["dbb7", "dbb4"])
@pytest.mark.parametrize(("channels", "kernel_size", "stride", "groups", "inner"), GRID)
def test_fusion_is_exact_in_float64(
    variant: str, channels: tuple[int, int], kernel_size: int, stride: int, groups: int, inner: int | None
) -> None:
    geometry = ConvGeometry(*channels, kernel_size, stride, kernel_size // 2, groups)
    block = _block(geometry, DBB4_BRANCHES if variant == "dbb4" else None, inner, torch.float64)
    if variant == "dbb7":
        expected = BRANCHES if channels[0] == channels[1] and stride == 1 else BRANCHES[:-1]
        assert block.branch_names == expected
    x = torch.randn(2, channels[0], 15, 15, dtype=torch.float64)
    assert _fusion_error(block, x) <= 1e-5


@pytest.mark.parametrize(("kernel_size", "stride"), [(3, 1), (5, 2)])
def test_fusion_in_float32_on_56x56(kernel_size: int, stride: int) -> None:
    geometry = ConvGeometry(32, 32, kernel_size, stride, kernel_size // 2, 2)
    block = _block(geometry, None, None, torch.float32)
    x = torch.randn(2, 32, 56, 56)
    assert _fusion_error(block, x) <= 1e-4


def test_depthwise_block_uses_the_direct_average_branch_and_fuses() -> None:
    geometry = ConvGeometry(32, 32, 3, 1, 1, 32)
    block = _block(geometry, None, 64, torch.float64)  # DBB's 2×C_in inner width for depthwise convs
    assert type(block.branch("conv1x1_avg")).__name__ == "AveragePoolBranch"
    assert _fusion_error(block, torch.randn(2, 32, 9, 9, dtype=torch.float64)) <= 1e-5


@pytest.mark.parametrize("padding", [0, 2])
def test_a_conv_not_padded_by_k_over_2_keeps_only_the_aligned_branches(padding: int) -> None:
    geometry = ConvGeometry(8, 8, 3, 1, padding, 1)
    assert geometry.available_branches() == ("conv1x1_kxk", "conv1x1_avg", "kxk")
    block = _block(geometry, None, None, torch.float64)
    assert _fusion_error(block, torch.randn(2, 8, 9, 9, dtype=torch.float64)) <= 1e-5


def test_even_kernels_have_no_centre_and_so_no_centred_branches() -> None:
    geometry = ConvGeometry(8, 8, 4, 1, 2, 1)
    assert "conv1x1" not in geometry.available_branches()
    block = _block(geometry, None, None, torch.float64)
    assert _fusion_error(block, torch.randn(2, 8, 9, 9, dtype=torch.float64)) <= 1e-5


def test_every_branch_gets_a_gradient_in_training() -> None:
    block = DiverseBranchBlock(ConvGeometry(8, 8, 3, 1, 1, 1)).train()
    block(torch.randn(4, 8, 7, 7)).square().mean().backward()
    for name, parameter in block.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_bad_geometry_and_branches_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="K >= 2"):
        ConvGeometry(8, 8, 1)
    with pytest.raises(ValueError, match="do not split into 3 groups"):
        ConvGeometry(8, 8, 3, groups=3)
    with pytest.raises(ValueError, match="unknown DBB branches \\['conv2x2'\\]"):
        DiverseBranchBlock(ConvGeometry(8, 8, 3, 1, 1), ["conv2x2"])
    with pytest.raises(ValueError, match="'identity'\\] are not available"):
        DiverseBranchBlock(ConvGeometry(8, 16, 3, 1, 1), ["identity"])
    with pytest.raises(ValueError, match="only square kernels"):
        ConvGeometry.of(torch.nn.Conv2d(8, 8, (3, 1)))
    with pytest.raises(ValueError, match="inner width 5 does not split into 2 groups"):
        DiverseBranchBlock(ConvGeometry(8, 8, 3, 1, 1, 2), inner_width=5)
