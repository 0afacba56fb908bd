"""extra["layout"]: a ResNet-family model or a ViT with its own blocks per stage and per-block internal widths.

The task carries it as JSON, build() makes it, the profiler's walk and export's standalone form agree with
the real module, and a layout equal to the family's own builds the very same network.
"""

from __future__ import annotations

import json

import pytest
import torch

from nestling.errors import ConfigError
from nestling.models import ModelConfig, build, family_of
from nestling.models.cost import count_macs, count_parameters
from nestling.spec import SubmodelSpec
from tests.methods.fedtrans.growth_helpers import TINY_VIT, family_without_layout

IMAGE = 16
GROWN = {"stage_blocks": [3, 4, 2], "block_hidden": [16, 32, 16, 48, 32, 32, 40, 64, 128]}


@pytest.mark.parametrize("arch", ["resnet20", "preresnet20"])
def test_a_layout_builds_the_blocks_and_widths_it_names(arch: str) -> None:
    model = ModelConfig(arch, image_size=IMAGE, extra={"layout": GROWN})
    net = build(SubmodelSpec(model))
    assert len(net.blocks) == 9
    convs = [(b.get_submodule("conv1"), b.get_submodule("conv2")) for b in net.blocks]
    assert [c1.out_channels for c1, _ in convs] == GROWN["block_hidden"]
    assert [c2.in_channels for _, c2 in convs] == GROWN["block_hidden"]
    assert [c2.out_channels for _, c2 in convs] == [16] * 3 + [32] * 4 + [64] * 2
    assert [info.stride for info in net.infos] == [1, 1, 1, 2, 1, 1, 1, 2, 1]
    assert net(torch.randn(2, 3, IMAGE, IMAGE)).shape == (2, 10)


def test_the_layout_survives_json_through_model_config() -> None:
    model = ModelConfig(
        "resnet20",
        extra={"layout": {"stage_blocks": (3, 4, 2), "block_hidden": tuple(GROWN["block_hidden"])}},
    )
    again = ModelConfig.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again == model
    assert again.extra["layout"] == GROWN
    assert hash(again) == hash(model)


@pytest.mark.parametrize("arch", ["resnet20", "preresnet20", "tinycnn", "vit"])
def test_the_family_layout_written_out_builds_the_same_network(arch: str) -> None:
    plain = ModelConfig(arch, image_size=IMAGE)
    family = family_of(arch)
    layout = {
        "stage_blocks": list(family.stage_depths({})),
        "block_hidden": list(family.block_hidden(IMAGE, {})),
    }
    explicit = plain.with_(extra={"layout": layout})
    torch.manual_seed(3)
    a = build(SubmodelSpec(plain))
    torch.manual_seed(3)
    b = build(SubmodelSpec(explicit))
    assert a.state_dict().keys() == b.state_dict().keys()
    for key, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[key]), key


@pytest.mark.parametrize("arch", ["resnet20", "preresnet20"])
def test_the_derived_costs_and_export_agree_with_a_grown_layout(arch: str) -> None:
    from nestling.export.standalone import build_standalone, plan_outputs
    from nestling.profiler.estimator import estimate

    model = ModelConfig(arch, num_classes=7, image_size=IMAGE, extra={"layout": GROWN})
    for spec in (SubmodelSpec(model), SubmodelSpec(model, width=0.5, blocks=(0, 2, 3, 5, 7))):
        torch.manual_seed(0)
        net = build(spec).eval()
        cost = estimate(spec, 4)
        assert cost.params == count_parameters(net)
        assert cost.forward_macs == count_macs(net, (3, IMAGE, IMAGE))
        standalone = build_standalone(net, plan_outputs(net))
        x = torch.randn(3, 3, IMAGE, IMAGE)
        with torch.no_grad():
            torch.testing.assert_close(standalone(x), net(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"stage_blocks": [3, 3, 3]}, "exactly stage_blocks and block_hidden"),
        ({"stage_blocks": [3, 0, 3], "block_hidden": [16] * 6}, "integers >= 1"),
        ({"stage_blocks": [3, 3, 3], "block_hidden": [16] * 8}, "has 8 entries"),
        ({"stage_blocks": [3, 3, 3], "block_hidden": [16.5] * 9}, "integers >= 1"),
        ("3,3,3", "must be a table"),
    ],
)
def test_a_malformed_layout_is_refused_by_name(layout: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig("resnet20", extra={"layout": layout})


def test_the_family_checks_the_stage_count_and_other_families_refuse_a_layout() -> None:
    two_stages = ModelConfig("resnet20", extra={"layout": {"stage_blocks": [3, 3], "block_hidden": [16] * 6}})
    with pytest.raises(ConfigError, match="3 stages of resnet20"):
        build(SubmodelSpec(two_stages))
    vit = ModelConfig("vit", extra={"layout": {"stage_blocks": [1, 1], "block_hidden": [8, 8]}})
    with pytest.raises(ConfigError, match="must list the 1 stage of vit"):
        build(SubmodelSpec(vit))
    with family_without_layout() as arch:
        other = ModelConfig(arch, extra={"layout": {"stage_blocks": [1], "block_hidden": [4]}})
        with pytest.raises(ConfigError, match="cannot build an extra.layout"):
            build(SubmodelSpec(other))


# -- the ViT: one stage of encoder blocks, block_hidden = each block's MLP hidden width --------------------------
VIT_GROWN = {"stage_blocks": [3], "block_hidden": [48, 24, 96]}


def _grown_vit(**changes: object) -> ModelConfig:
    return ModelConfig(
        "vit",
        image_size=IMAGE,
        extra={**TINY_VIT, "layout": VIT_GROWN},
        **changes,  # type: ignore[arg-type]
    )


def test_a_vit_layout_builds_its_encoder_blocks_and_mlp_widths() -> None:
    net = build(SubmodelSpec(_grown_vit()))
    assert len(net.blocks) == 3
    assert [b.get_submodule("fc1").out_features for b in net.blocks] == VIT_GROWN["block_hidden"]
    assert [b.get_submodule("fc2").in_features for b in net.blocks] == VIT_GROWN["block_hidden"]
    assert all(b.get_submodule("q").out_features == TINY_VIT["dim"] for b in net.blocks)  # attention as is
    assert net(torch.randn(2, 3, IMAGE, IMAGE)).shape == (2, 10)
    sliced = build(SubmodelSpec(_grown_vit(), width=0.5))
    assert [b.get_submodule("fc1").out_features for b in sliced.blocks] == [
        24,
        12,
        48,
    ]  # each block's own half


def test_a_grown_vit_described_to_a_board_builds_the_same_network() -> None:
    """The task's spec travels as JSON; the board's build holds the server's weights and computes the same."""
    spec = SubmodelSpec.full(_grown_vit())
    torch.manual_seed(5)
    server = build(spec).eval()
    received = SubmodelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert received == spec and received.model.extra["layout"] == VIT_GROWN
    board = build(received, init=False).eval()
    board.load_state_dict(server.state_dict(), strict=True)
    x = torch.randn(4, 3, IMAGE, IMAGE)
    with torch.no_grad():
        assert torch.equal(board(x), server(x))


def test_the_derived_costs_and_export_agree_with_a_grown_vit() -> None:
    from nestling.export.standalone import build_standalone, plan_outputs
    from nestling.profiler.estimator import estimate

    model = _grown_vit(num_classes=7)
    for spec in (SubmodelSpec(model), SubmodelSpec(model, width=0.5, blocks=(0, 2))):
        torch.manual_seed(0)
        net = build(spec).eval()
        cost = estimate(spec, 4)
        assert cost.params == count_parameters(net)
        assert cost.forward_macs == count_macs(net, (3, IMAGE, IMAGE))
        standalone = build_standalone(net, plan_outputs(net))
        x = torch.randn(3, 3, IMAGE, IMAGE)
        with torch.no_grad():
            torch.testing.assert_close(standalone(x), net(x), rtol=1e-4, atol=1e-5)
