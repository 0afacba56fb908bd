"""Slicing: every submodel tensor is the leading region of its global tensor; extract and scatter are pure
indexing and invert each other (METHODS §1.1, §2.b.4)."""

from __future__ import annotations

import math

import pytest
import torch

from nestling.errors import SpecError
from nestling.models import ModelConfig, build
from nestling.slicing import (
    check_compatible,
    check_result_tensors,
    extract,
    roles_for,
    scatter,
    shapes_for,
    slices_for,
)
from nestling.spec import SubmodelSpec

MODEL = ModelConfig("resnet20", image_size=16, exit_points=(4,))


@pytest.fixture(scope="module")
def global_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = build(SubmodelSpec.full(MODEL)).state_dict()
    for value in state.values():  # BN tensors would otherwise be constant 0/1 and hide slicing mistakes
        if value.is_floating_point():
            value.copy_(torch.randn(value.shape))
    return state


def test_regions_are_leading_slices_of_the_submodel_shapes() -> None:
    spec = SubmodelSpec(MODEL, width=0.5, blocks=(0, 1, 2, 3, 6), exits=(4,))
    shapes, regions = shapes_for(spec), slices_for(spec)
    assert set(shapes) == set(regions)
    for key, region in regions.items():
        assert region == tuple(slice(0, n) for n in shapes[key])


def test_extract_gives_the_built_submodel_exactly_its_weights(global_state: dict[str, torch.Tensor]) -> None:
    spec = SubmodelSpec(MODEL, width=math.sqrt(0.4), blocks=(0, 2, 3, 5, 8))
    sub = extract(global_state, spec)
    net = build(spec, init=False)
    net.load_state_dict(sub, strict=True)  # names and shapes match the physically smaller model
    assert torch.equal(sub["stem.conv.weight"], global_state["stem.conv.weight"][:11])
    assert torch.equal(sub["blocks.3.conv1.weight"], global_state["blocks.3.conv1.weight"][:21, :11])


def test_extract_then_scatter_is_the_identity(global_state: dict[str, torch.Tensor]) -> None:
    spec = SubmodelSpec(MODEL, width=0.3, blocks=(0, 4, 8), exits=(4,))
    target = {k: v.clone() for k, v in global_state.items()}
    scatter(target, extract(global_state, spec), spec)
    assert all(torch.equal(target[k], global_state[k]) for k in global_state)


def test_scatter_writes_only_the_submodel_region(global_state: dict[str, torch.Tensor]) -> None:
    spec = SubmodelSpec(MODEL, width=0.5, blocks=(0, 1))
    target = {k: v.clone() for k, v in global_state.items()}
    sub = {
        k: torch.full_like(v, 7.0) if v.is_floating_point() else v
        for k, v in extract(global_state, spec).items()
    }
    scatter(target, sub, spec)
    w = target["blocks.0.conv1.weight"]
    assert (w[:8, :8] == 7).all()
    assert torch.equal(w[8:], global_state["blocks.0.conv1.weight"][8:])
    assert torch.equal(w[:, 8:], global_state["blocks.0.conv1.weight"][:, 8:])
    assert torch.equal(
        target["blocks.5.conv1.weight"], global_state["blocks.5.conv1.weight"]
    )  # block not kept


def test_a_narrow_slice_is_contained_in_a_wider_one(global_state: dict[str, torch.Tensor]) -> None:
    narrow, wide = SubmodelSpec(MODEL, width=0.3), SubmodelSpec(MODEL, width=0.7)
    small, large = extract(global_state, narrow), extract(global_state, wide)
    for key, tensor in small.items():
        region = tuple(slice(0, n) for n in tensor.shape)
        assert torch.equal(large[key][region], tensor), key


def test_extract_copies_unless_asked_for_views(global_state: dict[str, torch.Tensor]) -> None:
    spec = SubmodelSpec(MODEL, width=0.5)
    copied = extract(global_state, spec)
    copied["head.fc.bias"].add_(1.0)
    assert not torch.equal(copied["head.fc.bias"], global_state["head.fc.bias"])
    views = extract(global_state, spec, copy=False, keys={"head.fc.bias"})
    assert set(views) == {"head.fc.bias"}
    assert views["head.fc.bias"].data_ptr() == global_state["head.fc.bias"].data_ptr()


def test_roles_split_norm_tensors_step_sizes_and_weights() -> None:
    roles = roles_for(SubmodelSpec(MODEL, exits=(4,)))
    assert roles["blocks.0.step"] == "step"
    assert roles["blocks.0.bn1.running_var"] == roles["blocks.3.shortcut.2.weight"] == "norm"
    assert roles["blocks.0.bn1.num_batches_tracked"] == "norm"
    assert roles["blocks.0.conv1.weight"] == roles["blocks.3.shortcut.0.weight"] == "weight"
    assert roles["head.fc.weight"] == roles["head.fc.bias"] == "weight"  # classifier bias is consistent
    assert set(roles) == set(shapes_for(SubmodelSpec(MODEL, exits=(4,))))


def test_layer_norms_have_their_own_role() -> None:
    vit = ModelConfig("vit", image_size=8, extra={"dim": 16, "depth": 2, "heads": 2, "mlp_dim": 32})
    roles = roles_for(SubmodelSpec.full(vit))
    assert roles["blocks.0.ln1.weight"] == roles["head.norm.bias"] == "layer_norm"
    assert roles["blocks.0.step_sa"] == roles["blocks.0.step_ffn"] == "step"
    assert roles["blocks.0.q.weight"] == roles["stem.pos_embed"] == "weight"


def test_incompatible_and_malformed_results_are_refused(global_state: dict[str, torch.Tensor]) -> None:
    spec = SubmodelSpec(MODEL, width=0.5)
    sub = extract(global_state, spec)
    check_result_tensors(sub, spec, global_state)
    check_compatible(global_state, spec)
    with pytest.raises(SpecError, match="not in submodel"):
        check_result_tensors({**sub, "blocks.99.conv1.weight": torch.zeros(1)}, spec, global_state)
    with pytest.raises(SpecError, match="has shape"):
        check_result_tensors({**sub, "head.fc.bias": torch.zeros(3)}, spec, global_state)
    with pytest.raises(SpecError, match="dtype"):
        check_result_tensors({**sub, "head.fc.bias": sub["head.fc.bias"].double()}, spec, global_state)
    bad = sub["head.fc.weight"].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(SpecError, match="NaN or Inf"):
        check_result_tensors({**sub, "head.fc.weight": bad}, spec, global_state)
    with pytest.raises(SpecError, match="does not fit"):
        check_compatible({**global_state, "head.fc.weight": torch.zeros(10, 4)}, spec)
