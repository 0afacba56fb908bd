"""Widen and deepen (METHODS §4.b 1, 2, 7): the grown model computes what its parent computed, in float32 and
float64, in train and eval mode, on post-activation and pre-activation ResNets and on the ViT (encoder blocks);
the parent is untouched and the grown model costs more MACs."""

from __future__ import annotations

import pytest
import torch

from nestling.errors import ConfigError
from nestling.methods.fedtrans import deepen, layout_of, model_macs, next_operation, transform, widen
from nestling.models import ModelConfig
from tests.methods.fedtrans.growth_helpers import (
    IMAGE,
    family_without_layout,
    net_of,
    outputs,
    tiny_vit,
    trained_looking,
)

ARCHS = ["resnet20", "preresnet20"]
PRECISION = {torch.float32: 1e-5, torch.float64: 1e-10}


def _config(arch: str) -> ModelConfig:
    return ModelConfig(arch, image_size=IMAGE)


def _input(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(6, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(7), dtype=dtype)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("train", [False, True])
def test_widen_preserves_the_outputs(arch: str, dtype: torch.dtype, train: bool) -> None:
    config = _config(arch)
    state = trained_looking(config, dtype=dtype)
    x = _input(dtype)
    grown = widen(state, config, 4, 2.0, torch.Generator().manual_seed(1))
    assert layout_of(grown.config).block_hidden[4] == 64
    assert grown.state["blocks.4.conv1.weight"].dtype == dtype
    before, after = outputs(config, state, x, train=train), outputs(grown.config, grown.state, x, train=train)
    tolerance = PRECISION[dtype]
    torch.testing.assert_close(after, before, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("arch", ARCHS)
def test_widened_replicas_fire_alike_and_their_outgoing_columns_sum_to_the_original(arch: str) -> None:
    config = _config(arch)
    state = trained_looking(config, dtype=torch.float64)
    grown = widen(state, config, 1, 2.0, torch.Generator().manual_seed(2))
    old_rows, new_rows = state["blocks.1.conv1.weight"], grown.state["blocks.1.conv1.weight"]
    source = [next(u for u in range(16) if torch.equal(new_rows[j], old_rows[u])) for j in range(32)]
    assert source[:16] == list(range(16))
    old_cols, new_cols = state["blocks.1.conv2.weight"], grown.state["blocks.1.conv2.weight"]
    for unit in range(16):
        group = [j for j, u in enumerate(source) if u == unit]
        torch.testing.assert_close(new_cols[:, group].sum(dim=1), old_cols[:, unit], rtol=0, atol=1e-12)

    net = net_of(grown.config, grown.state, train=False)
    seen: dict[str, torch.Tensor] = {}
    hidden_norm = net.blocks[1].bn2 if arch == "preresnet20" else net.blocks[1].bn1
    hidden_norm.register_forward_hook(lambda m, i, o: seen.setdefault("hidden", o))
    with torch.no_grad():
        net(_input(torch.float64))
    for j, unit in enumerate(source):
        torch.testing.assert_close(seen["hidden"][:, j], seen["hidden"][:, unit], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("train", [False, True])
def test_deepen_is_an_exact_identity(arch: str, dtype: torch.dtype, train: bool) -> None:
    config = _config(arch)
    state = trained_looking(config, dtype=dtype)
    x = _input(dtype)
    grown = deepen(state, config, 1, 2, torch.Generator().manual_seed(3))
    assert layout_of(grown.config).stage_blocks == (3, 4, 3)
    assert [o.kind for o in grown.provenance].count("inserted") == 1
    assert grown.provenance[5].kind == "inserted" and grown.provenance[6].parent_cell == 5
    assert torch.equal(grown.state["blocks.6.conv1.weight"], state["blocks.5.conv1.weight"])
    assert torch.equal(
        outputs(grown.config, grown.state, x, train=train), outputs(config, state, x, train=train)
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_an_inserted_block_learns(arch: str) -> None:
    config = _config(arch)
    grown = deepen(trained_looking(config), config, 2, 1, torch.Generator().manual_seed(4))
    net = net_of(grown.config, grown.state, train=True)
    loss = net(_input(torch.float32)).square().mean()
    loss.backward()
    block = net.blocks[grown.provenance.index(next(o for o in grown.provenance if o.kind == "inserted"))]
    last = block.conv2.weight if arch == "preresnet20" else block.bn2.weight
    assert last.grad is not None and float(last.grad.abs().sum()) > 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_transformation_of_several_cells_preserves_outputs_leaves_the_parent_and_costs_more(
    arch: str, dtype: torch.dtype
) -> None:
    config = _config(arch)
    state = trained_looking(config, dtype=dtype)
    kept = {k: v.clone() for k, v in state.items()}
    x = _input(dtype)
    rng = torch.Generator().manual_seed(5)
    first = transform(state, config, [0, 4, 8], [0] * 9, rng)
    assert first.applied == (("widen", 0), ("widen", 4), ("widen", 8))
    assert first.operations_done == (1, 0, 0, 0, 1, 0, 0, 0, 1)
    second = transform(first.state, first.config, [0, 4, 5], first.operations_done, rng)
    assert second.applied == (
        ("widen", 5),
        ("deepen", 4),
        ("deepen", 0),
    )  # widens first, deepens deepest first
    assert layout_of(second.config).stage_blocks == (4, 4, 3)
    assert layout_of(second.config).block_hidden == (32, 16, 16, 16, 32, 64, 32, 64, 64, 64, 128)
    assert second.operations_done == (2, 0, 0, 0, 0, 2, 0, 1, 0, 0, 1)
    assert [o.kind for o in second.provenance].count("inserted") == 2
    tolerance = PRECISION[dtype]
    for train in (False, True):
        torch.testing.assert_close(
            outputs(second.config, second.state, x, train=train),
            outputs(config, state, x, train=train),
            rtol=tolerance,
            atol=tolerance,
        )
    assert all(torch.equal(state[k], kept[k]) for k in kept)  # the parent's weights are untouched
    assert model_macs(config) < model_macs(first.config) < model_macs(second.config)


def test_symmetry_breaking_noise_moves_only_the_new_units_and_is_off_by_default() -> None:
    config = _config("resnet20")
    state = trained_looking(config)
    quiet = widen(state, config, 3, 2.0, torch.Generator().manual_seed(6))
    noisy = widen(state, config, 3, 2.0, torch.Generator().manual_seed(6), noise=0.05)
    rows_quiet, rows_noisy = quiet.state["blocks.3.conv1.weight"], noisy.state["blocks.3.conv1.weight"]
    assert torch.equal(rows_quiet[:32], rows_noisy[:32])
    assert not torch.equal(rows_quiet[32:], rows_noisy[32:])
    x = _input(torch.float32)
    assert not torch.allclose(
        outputs(noisy.config, noisy.state, x, train=False), outputs(config, state, x, train=False)
    )


def test_the_schedule_alternates_starting_with_widen() -> None:
    assert [next_operation(n) for n in range(4)] == ["widen", "deepen", "widen", "deepen"]
    assert next_operation(0, first="deepen") == "deepen"
    with pytest.raises(ConfigError, match="starts with one of"):
        next_operation(0, first="stretch")


def test_bad_growth_requests_are_refused_by_name() -> None:
    config = _config("resnet20")
    state = trained_looking(config)
    with pytest.raises(ConfigError, match="does not grow"):
        widen(state, config, 0, 1.0)
    with pytest.raises(ConfigError, match="cells 0..8"):
        widen(state, config, 9)
    with pytest.raises(ConfigError, match="strided first block"):
        deepen(state, config, 1, 0)
    with pytest.raises(ConfigError, match="stages 0..2"):
        deepen(state, config, 3, 1)
    with family_without_layout() as arch, pytest.raises(ConfigError, match="has no growable blocks"):
        widen({}, ModelConfig(arch), 0)
    with pytest.raises(ConfigError, match="exit_points must be empty"):
        widen(state, config.with_(exit_points=(2,)), 0)
    with pytest.raises(ConfigError, match="does not hold the 10 blocks"):
        widen(
            state,
            config.with_(
                extra={"layout": {"stage_blocks": [4, 3, 3], "block_hidden": [16] * 4 + [32] * 3 + [64] * 3}}
            ),
            0,
        )
    with pytest.raises(ConfigError, match="operations_done has 2 entries"):
        transform(state, config, [0], [0, 0], torch.Generator())


@pytest.mark.parametrize("train", [False, True])
def test_the_tiny_cnn_grows_as_a_resnet_family(train: bool) -> None:
    config = ModelConfig("tinycnn", image_size=IMAGE)
    state = trained_looking(config)
    grown = transform(state, config, [0, 1], [1, 0], torch.Generator().manual_seed(8))
    assert grown.applied == (("widen", 1), ("deepen", 0))
    assert layout_of(grown.config).stage_blocks == (2, 1)
    x = _input(torch.float32)
    torch.testing.assert_close(
        outputs(grown.config, grown.state, x, train=train),
        outputs(config, state, x, train=train),
        rtol=1e-5,
        atol=1e-5,
    )
    assert model_macs(grown.config) > model_macs(config)


# -- the ViT: cells are encoder blocks, widened in their MLP hidden width, deepened by a zero-output block --------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("train", [False, True])
def test_widening_a_vit_encoder_blocks_mlp_preserves_the_outputs(dtype: torch.dtype, train: bool) -> None:
    config = tiny_vit()
    state = trained_looking(config, dtype=dtype)
    grown = widen(state, config, 1, 2.0, torch.Generator().manual_seed(1))
    assert layout_of(grown.config).block_hidden == (24, 48)
    assert grown.state["blocks.1.fc1.weight"].shape == (48, 16) and grown.state[
        "blocks.1.fc1.bias"
    ].shape == (48,)
    assert (
        grown.state["blocks.1.fc2.weight"].shape == (16, 48)
        and grown.state["blocks.1.fc2.weight"].dtype == dtype
    )
    assert all(torch.equal(grown.state[k], state[k]) for k in state if not k.startswith("blocks.1.fc"))
    x = _input(dtype)
    tolerance = PRECISION[dtype]
    torch.testing.assert_close(
        outputs(grown.config, grown.state, x, train=train),
        outputs(config, state, x, train=train),
        rtol=tolerance,
        atol=tolerance,
    )


def test_widened_vit_units_fire_alike_and_their_fc2_columns_sum_to_the_original() -> None:
    config = tiny_vit()
    state = trained_looking(config, dtype=torch.float64)
    grown = widen(state, config, 0, 2.0, torch.Generator().manual_seed(2))
    old_rows, new_rows = state["blocks.0.fc1.weight"], grown.state["blocks.0.fc1.weight"]
    source = [next(u for u in range(24) if torch.equal(new_rows[j], old_rows[u])) for j in range(48)]
    assert source[:24] == list(range(24))
    assert torch.equal(grown.state["blocks.0.fc1.bias"], state["blocks.0.fc1.bias"][source])
    old_cols, new_cols = state["blocks.0.fc2.weight"], grown.state["blocks.0.fc2.weight"]
    for unit in range(24):
        group = [j for j, u in enumerate(source) if u == unit]
        torch.testing.assert_close(new_cols[:, group].sum(dim=1), old_cols[:, unit], rtol=0, atol=1e-12)

    net = net_of(grown.config, grown.state, train=False)
    seen: dict[str, torch.Tensor] = {}
    net.blocks[0].fc1.register_forward_hook(lambda m, i, o: seen.setdefault("hidden", o))
    with torch.no_grad():
        net(_input(torch.float64))
    for j, unit in enumerate(source):
        torch.testing.assert_close(seen["hidden"][..., j], seen["hidden"][..., unit], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("train", [False, True])
def test_an_inserted_vit_encoder_block_is_an_exact_identity(dtype: torch.dtype, train: bool) -> None:
    config = tiny_vit()
    state = trained_looking(config, dtype=dtype)
    grown = deepen(state, config, 0, 1, torch.Generator().manual_seed(3))
    assert layout_of(grown.config).stage_blocks == (3,) and layout_of(grown.config).block_hidden == (
        24,
        24,
        24,
    )
    assert [o.kind for o in grown.provenance] == ["inherited", "inserted", "inherited"]
    assert torch.equal(grown.state["blocks.2.fc1.weight"], state["blocks.1.fc1.weight"])
    inserted = {k: v for k, v in grown.state.items() if k.startswith("blocks.1.")}
    assert all(
        float(inserted[f"blocks.1.{n}"].abs().sum()) == 0 for n in ("proj.weight", "proj.bias", "fc2.weight")
    )
    assert float(inserted["blocks.1.q.weight"].abs().sum()) > 0  # the rest is freshly initialised
    assert inserted["blocks.1.fc1.weight"].dtype == dtype
    x = _input(dtype)
    assert torch.equal(
        outputs(grown.config, grown.state, x, train=train), outputs(config, state, x, train=train)
    )


def test_an_inserted_vit_encoder_block_learns() -> None:
    config = tiny_vit()
    grown = deepen(trained_looking(config), config, 0, 2, torch.Generator().manual_seed(4))
    net = net_of(grown.config, grown.state, train=True)
    net(_input(torch.float32)).square().mean().backward()
    block = net.blocks[2]
    for weight in (block.proj.weight, block.fc2.weight):
        assert weight.grad is not None and float(weight.grad.abs().sum()) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_transforming_several_vit_cells_preserves_outputs_leaves_the_parent_and_costs_more(
    dtype: torch.dtype,
) -> None:
    config = tiny_vit()
    state = trained_looking(config, dtype=dtype)
    kept = {k: v.clone() for k, v in state.items()}
    rng = torch.Generator().manual_seed(5)
    first = transform(state, config, [0, 1], [0, 1], rng)
    assert first.applied == (("widen", 0), ("deepen", 1))
    assert layout_of(first.config).block_hidden == (48, 24, 24)
    assert first.operations_done == (1, 2, 0)
    second = transform(first.state, first.config, [0, 2], first.operations_done, rng, noise=0.0)
    assert second.applied == (("widen", 2), ("deepen", 0))
    assert layout_of(second.config).block_hidden == (48, 24, 24, 48)
    x = _input(dtype)
    tolerance = PRECISION[dtype]
    for train in (False, True):
        torch.testing.assert_close(
            outputs(second.config, second.state, x, train=train),
            outputs(config, state, x, train=train),
            rtol=tolerance,
            atol=tolerance,
        )
    assert all(torch.equal(state[k], kept[k]) for k in kept)
    assert model_macs(config) < model_macs(first.config) < model_macs(second.config)
