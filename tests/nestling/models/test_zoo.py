"""`build(spec)`: physically smaller submodels whose tensor shapes follow METHODS §1.1, for every zoo model."""

from __future__ import annotations

import math

import pytest
import torch

from nestling.errors import ConfigError, SpecError
from nestling.models import ModelConfig, block_infos, build, class_logit_keys, known_models
from nestling.models.cost import count_parameters
from nestling.slicing import shapes_for
from nestling.spec import SubmodelSpec


def stage_entry_widths(spec: SubmodelSpec) -> tuple[int, ...]:
    """Output channels of the first conv of every stage, read off the built submodel's shapes."""
    shapes = shapes_for(spec)
    infos = block_infos(spec)
    firsts = [b.index for b in infos if b.index == 0 or infos[b.index - 1].stage != b.stage]
    return tuple(shapes[f"blocks.{i}.conv1.weight"][0] for i in firsts)


@pytest.mark.parametrize(
    ("gamma", "expected"),
    [
        (0.2, (29, 58, 115, 229)),
        (0.4, (41, 81, 162, 324)),
        (0.6, (50, 100, 199, 397)),
        (0.8, (58, 115, 229, 458)),
        (0.34, (38, 75, 150, 299)),
        (1.0, (64, 128, 256, 512)),
    ],
)
def test_built_resnet18_has_the_ceil_rule_stage_widths(gamma: float, expected: tuple[int, ...]) -> None:
    assert stage_entry_widths(SubmodelSpec(ModelConfig("resnet18"), width=math.sqrt(gamma))) == expected


@pytest.mark.parametrize("arch", ["resnet20", "resnet56", "resnet110"])
@pytest.mark.parametrize(
    ("gamma", "expected"),
    [
        (0.2, (8, 15, 29)),
        (0.4, (11, 21, 41)),
        (0.6, (13, 25, 50)),
        (0.8, (15, 29, 58)),
        (1.0, (16, 32, 64)),
    ],
)
def test_built_cifar_resnets_have_the_ceil_rule_stage_widths(
    arch: str, gamma: float, expected: tuple
) -> None:
    assert stage_entry_widths(SubmodelSpec(ModelConfig(arch), width=math.sqrt(gamma))) == expected


@pytest.mark.parametrize(("s_w", "expected"), [(0.7, (11, 22, 44)), (0.75, (12, 24, 48))])
def test_built_scalefl_resnet_floors_its_widths(s_w: float, expected: tuple[int, ...]) -> None:
    model = ModelConfig("resnet110", rounding="floor", scaler="always", norm_stats="batch")
    assert stage_entry_widths(SubmodelSpec(model, width=s_w)) == expected


@pytest.mark.parametrize("arch", ["tinycnn", "resnet20", "preresnet20", "resnet18", "resnet34", "vit"])
@pytest.mark.parametrize("width", [0.3, 0.7])
def test_image_channels_and_class_rows_are_never_sliced(arch: str, width: float) -> None:
    model = ModelConfig(arch, num_classes=7)
    shapes, full = shapes_for(SubmodelSpec(model, width=width)), shapes_for(SubmodelSpec.full(model))
    stem = "stem.proj.weight" if arch == "vit" else "stem.conv.weight"
    assert shapes[stem][1] == 3
    assert shapes["head.fc.weight"][0] == 7
    assert shapes["head.fc.bias"] == full["head.fc.bias"] == (7,)
    assert shapes["head.fc.weight"][1] < full["head.fc.weight"][1]  # its inputs are sliced


@pytest.mark.parametrize("arch", ["tinycnn", "resnet20", "preresnet20", "resnet18", "vit"])
def test_a_narrower_submodel_is_a_leading_region_of_a_wider_one(arch: str) -> None:
    model = ModelConfig(arch)
    small, large = shapes_for(SubmodelSpec(model, width=0.4)), shapes_for(SubmodelSpec(model, width=0.8))
    full = shapes_for(SubmodelSpec.full(model))
    assert set(small) == set(large) == set(full)  # same keys in every submodel and the global model
    for key in small:
        assert all(s <= m <= f for s, m, f in zip(small[key], large[key], full[key])), key


def test_projection_shortcut_takes_the_block_input_prefix_and_output_prefix() -> None:
    shapes = shapes_for(SubmodelSpec(ModelConfig("resnet20"), width=0.5))
    # Block 3 is stage 2's entry: 16 → 32 channels at stride 2, so it has a 1×1 projection.
    assert shapes["blocks.3.shortcut.0.weight"] == (16, 8, 1, 1)
    assert shapes["blocks.3.conv1.weight"] == (16, 8, 3, 3)


@pytest.mark.parametrize("arch", ["tinycnn", "resnet20", "preresnet20", "vit"])
def test_every_small_model_forwards_a_batch_to_class_logits(arch: str) -> None:
    torch.manual_seed(0)
    model = ModelConfig(
        arch,
        num_classes=5,
        image_size=16,
        extra={"dim": 32, "depth": 2, "heads": 2, "mlp_dim": 64} if arch == "vit" else {},
    )
    for width in (0.5, 1.0):
        net = build(SubmodelSpec(model, width=width))
        net.eval()
        assert net(torch.randn(2, 3, 16, 16)).shape == (2, 5)


def test_resnet18_uses_a_max_pool_after_the_stem() -> None:
    infos = block_infos("resnet18", 32)
    assert infos[0].in_size == 16  # 32×32 → max-pool stride 2 → 16×16
    assert [b.stride for b in infos] == [1, 1, 2, 1, 2, 1, 2, 1]
    assert block_infos("resnet20", 32)[0].in_size == 32


def test_full_resnet18_has_the_standard_parameter_count_plus_one_step_per_block() -> None:
    # 11,173,962 = the usual 10-class ResNet-18 (option-B shortcuts); + 8 step sizes.
    assert (
        count_parameters(build(SubmodelSpec.full(ModelConfig("resnet18")), device="meta")) == 11_173_962 + 8
    )
    resnet20 = build(SubmodelSpec.full(ModelConfig("resnet20")), device="meta")
    assert sum(1 for n, _ in resnet20.named_parameters() if n.endswith(".step")) == 9


def test_the_cifar_resnet18_of_fjord_and_depthfl_keeps_the_full_resolution_without_max_pool() -> None:
    """METHODS §1.5: stem 3×3 (64) + BN + ReLU, no max-pool, layer 1 at 32×32, 512 → K linear after GAP."""
    infos = block_infos("resnet18-cifar", 32)
    assert infos[0].in_size == 32 and infos[-1].out_size == 4  # avg_pool(4) = global average pool
    assert [b.stride for b in infos] == [1, 1, 2, 1, 2, 1, 2, 1]
    assert [b.global_out for b in infos] == [64, 64, 128, 128, 256, 256, 512, 512]
    net = build(SubmodelSpec.full(ModelConfig("resnet18-cifar", learnable_step=False)), device="meta")
    assert sum(p.numel() for p in net.parameters() if p.requires_grad) == 11_173_962  # kuangliu's count
    assert "resnet18-cifar" in known_models()


def test_exits_follow_their_blocks_and_depth_truncation_drops_later_blocks() -> None:
    model = ModelConfig("resnet20", exit_points=(2, 5))
    net = build(SubmodelSpec(model, depth=6, exits=(2, 5), head=False))
    assert len(net.blocks) == 6 and net.head is None
    outputs = net.forward_all(torch.randn(2, 3, 16, 16))
    assert len(outputs) == 2 and all(o.shape == (2, 10) for o in outputs)
    assert not any(k.startswith(("blocks.6.", "blocks.8.")) for k in net.state_dict())


def test_impossible_specs_fail_with_errors_naming_the_problem() -> None:
    model = ModelConfig("resnet20")
    with pytest.raises(SpecError, match="width"):
        SubmodelSpec(model, width=0.0)
    with pytest.raises(SpecError, match="keeps no residual block"):
        build(SubmodelSpec(model, blocks=()), device="meta")
    with pytest.raises(SpecError, match="do not exist"):
        build(SubmodelSpec(model, blocks=(0, 42)), device="meta")
    with pytest.raises(SpecError, match="exceeds"):
        build(
            SubmodelSpec(ModelConfig("resnet20", exit_points=(2,)), depth=12, exits=(2,), head=False),
            device="meta",
        )
    with pytest.raises(ConfigError, match="unknown model 'resnet9000'.*known"):
        build(SubmodelSpec(ModelConfig("resnet9000")))


def test_known_models_lists_the_zoo() -> None:
    assert {
        "tinycnn",
        "resnet20",
        "resnet56",
        "resnet110",
        "preresnet20",
        "resnet18",
        "resnet34",
        "vit",
    } <= set(known_models())


def test_meta_builds_allocate_nothing() -> None:
    net = build(SubmodelSpec.full(ModelConfig("resnet34")), device="meta")
    assert all(p.is_meta for p in net.parameters())


@pytest.mark.parametrize("arch", known_models())
def test_class_logit_keys_are_every_classifier_of_every_family_with_its_exits(arch: str) -> None:
    """Masked CE (HeteroFL) masks these by class row: they must be the head's and every exit's logit layer in
    each family, found without relying on a name. Seven classes: no other tensor of these nets has 7 rows."""
    exits = (1,) if arch != "vit" else ()
    model = ModelConfig(arch, num_classes=7, exit_points=exits)
    spec = SubmodelSpec(model, exits=exits)
    net = build(spec)
    linear = {
        f"{name}.{tensor}"
        for name, module in net.named_modules()
        if isinstance(module, torch.nn.Linear)
        for tensor, _ in module.named_parameters(recurse=False)
    }
    seven_rows = {key for key, value in net.state_dict().items() if value.dim() and value.shape[0] == 7}
    keys = class_logit_keys(spec)
    assert keys == seven_rows & linear
    assert {"head.fc.weight", "head.fc.bias"} <= keys
    assert len(keys) == 2 * (1 + len(exits))
