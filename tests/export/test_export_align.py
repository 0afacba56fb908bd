"""Channel alignment: zero-padded feature maps leave every output unchanged, and convolutions SIMD-sized."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nestling.errors import SpecError
from nestling.export.align import align_channels, alignable, aligned
from nestling.export.standalone import build_standalone, plan_outputs
from nestling.models import ModelConfig, build
from nestling.spec import SubmodelSpec

SPECS = {
    "nefl-wd k1 (11/22/43 channels)": SubmodelSpec(
        ModelConfig("resnet20"), width=0.2**0.25, blocks=(0, 1, 3, 4, 6, 7)
    ),
    "pre-activation affines": SubmodelSpec(ModelConfig("preresnet20"), width=0.3),
    "depthwise convs and a sigmoid gate": SubmodelSpec(
        ModelConfig("resnet20", exit_points=(2, 5), exit_kind="depthfl"), width=0.7, exits=(2, 5)
    ),
    "scalefl exits": SubmodelSpec(
        ModelConfig("resnet20", scaler="always", rounding="floor", exit_kind="scalefl", exit_points=(3,)),
        width=0.45,
        depth=4,
        exits=(3,),
        head=False,
    ),
}


@pytest.mark.parametrize("case", list(SPECS))
def test_aligned_graph_computes_the_same_outputs(case: str) -> None:
    torch.manual_seed(0)
    net = build(SPECS[case]).eval()
    plan = plan_outputs(net, all_exits=True)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        expected = build_standalone(net, plan)(x)
        padded = align_channels(build_standalone(net, plan), 8)
        got = padded(x)
    expected = [expected] if isinstance(expected, torch.Tensor) else expected
    got = [got] if isinstance(got, torch.Tensor) else got
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    convs = [m for m in padded.modules() if isinstance(m, nn.Conv2d)]
    assert convs[0].in_channels == 3  # the image is never padded
    assert all(c.out_channels % 8 == 0 for c in convs) and all(c.in_channels % 8 == 0 for c in convs[1:])


def test_aligned_counts_round_up_to_the_multiple() -> None:
    assert [aligned(c, 8) for c in (1, 8, 11, 22, 43, 64)] == [8, 8, 16, 24, 48, 64]


def test_vit_is_not_alignable() -> None:
    net = build(SubmodelSpec(ModelConfig("vit"), width=0.5)).eval()
    standalone = build_standalone(net, plan_outputs(net))
    assert not alignable(standalone)
    with pytest.raises(SpecError, match="convolutional"):
        align_channels(standalone, 8)
    assert align_channels(standalone, 1) is standalone
