"""The analytic estimator against the real modules: parameters and MACs exactly, saved activations as measured."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nestling.models import ModelConfig, build
from nestling.models.cost import count_macs, count_parameters
from nestling.profiler.estimator import estimate, training_memory
from nestling.profiler.measure import profile_model
from nestling.spec import SubmodelSpec


def measured_activations(spec: SubmodelSpec, batch: int) -> tuple[dict[str, int], int]:
    profile = profile_model(spec, batch, repeats=1, warmup=0, rss_check=False)
    parts = {p["name"]: p["memory"]["activations_bytes"] for p in profile["parts"]}
    return parts, profile["total"]["activations_bytes"]


@pytest.mark.parametrize(
    "model",
    [ModelConfig("resnet20"), ModelConfig("preresnet20", norm_stats="batch"), ModelConfig("resnet18")],
    ids=lambda m: m.arch,
)
def test_activation_estimate_is_within_10_percent_of_the_measured_bytes_for_every_block(
    model: ModelConfig,
) -> None:
    spec = SubmodelSpec(model)
    measured, total = measured_activations(spec, 32)
    estimated = estimate(spec, 32)
    assert [p.name for p in estimated.parts] == list(measured)
    for part in estimated.parts:
        assert part.activation_bytes == pytest.approx(measured[part.name], rel=0.10), part.name
    assert estimated.activation_bytes == pytest.approx(total, rel=0.10)


@pytest.mark.parametrize(
    "spec",
    [
        SubmodelSpec(ModelConfig("preresnet20", norm_stats="batch", scaler="train"), width=0.5),
        SubmodelSpec(
            ModelConfig(
                "resnet20", scaler="always", exit_points=(2, 5), exit_kind="scalefl", rounding="floor"
            ),
            width=0.7,
            depth=6,
            exits=(2, 5),
            head=False,
        ),
        SubmodelSpec(
            ModelConfig("resnet18", exit_points=(1, 3, 5), exit_kind="depthfl"), width=0.6, exits=(1, 3, 5)
        ),
        SubmodelSpec(ModelConfig("vit", exit_points=(2,)), width=0.5, exits=(2,), blocks=(0, 1, 2, 4)),
        SubmodelSpec(
            ModelConfig(
                "resnet56", learnable_step=False, width_levels=(0.25, 0.5, 1.0), norm_stats="per_width"
            ),
            width=0.5,
            blocks=(0, 1, 2, 9, 10, 18, 19, 20),
        ),
        SubmodelSpec(ModelConfig("preresnet20", exit_points=(2, 5), exit_kind="fedepth"), exits=(2, 5)),
    ],
    ids=["scaler", "scalefl-exits", "depthfl-exits", "vit", "per-width-bn", "fedepth-aux-heads"],
)
def test_every_model_family_is_estimated_like_it_is_measured(spec: SubmodelSpec) -> None:
    measured, total = measured_activations(spec, 4)
    estimated = estimate(spec, 4)
    for part in estimated.parts:
        assert part.activation_bytes == pytest.approx(measured[part.name], rel=0.10, abs=64), part.name
    assert estimated.activation_bytes == pytest.approx(total, rel=0.10)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from(["resnet20", "preresnet20", "resnet18", "vit", "tinycnn"]),
    width=st.floats(0.05, 1.0),
    rounding=st.sampled_from(["ceil", "floor"]),
    data=st.data(),
)
def test_parameters_and_macs_match_the_built_model(
    arch: str, width: float, rounding: str, data: st.DataObject
) -> None:
    model = ModelConfig(arch, rounding=rounding, num_classes=7, image_size=16)
    blocks = len(estimate(SubmodelSpec(model), 1).parts) - 2
    kept = data.draw(st.sets(st.integers(0, blocks - 1), min_size=1))
    spec = SubmodelSpec(model, width=width, blocks=tuple(kept))
    net = build(spec)
    cost = estimate(spec, 2)
    assert cost.params == count_parameters(net)
    assert cost.forward_macs == count_macs(net, (3, 16, 16))
    assert cost.training_macs == 3 * cost.forward_macs


def test_training_memory_adds_weights_gradients_momentum_and_activations() -> None:
    spec = SubmodelSpec(ModelConfig("resnet20", norm_stats="batch"), width=0.5)
    cost = estimate(spec, 16)
    weights = 4 * cost.params
    assert cost.training_bytes == 3 * weights + cost.activation_bytes
    assert estimate(spec, 16, momentum=False).training_bytes == 2 * weights + cost.activation_bytes
    assert training_memory(spec, 32) > training_memory(spec, 16)  # activations grow with the batch


def test_activations_scale_linearly_with_the_batch() -> None:
    spec = SubmodelSpec(ModelConfig("preresnet20", norm_stats="batch"))
    small, large = estimate(spec, 8).activation_bytes, estimate(spec, 64).activation_bytes
    assert large == pytest.approx(8 * small, rel=0.01)  # BN statistics are the only per-batch constants
