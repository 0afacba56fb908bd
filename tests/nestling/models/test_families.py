"""Every registered model family, held to its own real module: the profiler's derived costs (parameters, MACs
and saved activation bytes equal to a real training step's), export's standalone form and the derived default
form (same outputs), block listing, client grouping and the NeFL presets. A new family is covered by
registering it."""

from __future__ import annotations

import pytest
import torch

from nestling.models import ModelConfig, build, family_of, registered_families
from nestling.models.cost import count_macs, count_parameters
from nestling.spec import SubmodelSpec

IMAGE = 16
FAMILIES = sorted(registered_families())


def _specs(arch: str) -> list[SubmodelSpec]:
    """The full model and a narrow one that skips every other block (each family builds both)."""
    model = ModelConfig(arch, num_classes=7, image_size=IMAGE)
    count = len(family_of(arch).block_infos(IMAGE, {}))
    return [SubmodelSpec(model), SubmodelSpec(model, width=0.5, blocks=tuple(range(0, count, 2)))]


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_estimated_costs_match_a_real_training_step(arch: str) -> None:
    from nestling.profiler.estimator import estimate
    from nestling.profiler.measure import profile_model

    for spec in _specs(arch):
        net = build(spec)
        cost = estimate(spec, 4)
        assert cost.params == count_parameters(net), spec
        assert cost.forward_macs == count_macs(net, (3, IMAGE, IMAGE)), spec
        profile = profile_model(spec, 4, repeats=1, warmup=0, rss_check=False)
        measured = {p["name"]: p["memory"]["activations_bytes"] for p in profile["parts"]}
        assert [p.name for p in cost.parts] == list(measured)
        for part in cost.parts:  # the bytes autograd keeps, as its saved-tensor hooks count them
            assert part.activation_bytes == measured[part.name], (spec, part.name)
        assert cost.activation_bytes == profile["total"]["activations_bytes"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_standalone_form_gives_the_same_outputs(arch: str) -> None:
    from nestling.export.standalone import build_standalone, plan_outputs

    for spec in _specs(arch):
        torch.manual_seed(0)
        net = build(spec).eval()
        standalone = build_standalone(net, plan_outputs(net))
        x = torch.randn(3, 3, IMAGE, IMAGE)
        with torch.no_grad():
            reference = net(x)
            # float32 rounding scales with the largest output: untrained deep ResNets in eval mode (BN with unit
            # statistics over dozens of residual sums) reach 1e1-1e5, where 1e-5 absolute is below an ulp.
            scale = max(1.0, float(reference.abs().max()))
            torch.testing.assert_close(standalone(x), reference, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_derived_default_standalone_form_gives_the_same_outputs(arch: str) -> None:
    """export's generic form (no family code) holds for every family, skipped blocks' projections included."""
    from nestling.export.standalone import KIT, StandaloneNet, plan_outputs
    from nestling.models.family import ModelFamily

    default = ModelFamily()
    for spec in _specs(arch):
        torch.manual_seed(0)
        net = build(spec).eval()
        plan = plan_outputs(net)
        blocks = [default.standalone_part(b, KIT) for b in net.blocks]
        assert all(b is not None for b in blocks)
        head = default.standalone_part(net.head, KIT)
        standalone = StandaloneNet(
            default.standalone_part(net.stem, KIT), [torch.nn.Sequential(*blocks)], [head], plan
        ).eval()
        kinds = {type(m).__name__ for m in standalone.modules()}
        assert not kinds & {"SlimConv2d", "SlimLinear", "SlimBatchNorm2d", "SlimLayerNorm", "Scaler"}
        x = torch.randn(3, 3, IMAGE, IMAGE)
        with torch.no_grad():
            reference = net(x)
            scale = max(1.0, float(reference.abs().max()))
            torch.testing.assert_close(standalone(x), reference, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("arch", FAMILIES)
def test_blocks_grouping_and_presets_are_answered_by_the_family(arch: str) -> None:
    from nestling.server.strategies.nefl_presets import nefl_family
    from nestling.simulator.grouped import groupable

    family = family_of(arch)
    spec = _specs(arch)[0]
    net = build(spec)
    assert len(net.blocks) == len(family.block_infos(IMAGE, {})) == sum(family.stage_depths({}))
    assert groupable(net) == family.groupable
    count = len(net.blocks)
    for mode in ("w", "d", "wd"):
        presets = nefl_family(arch, mode)
        assert len(presets) == 5 and presets[-1] == (1.0, None)
        for width, kept in presets:
            build(SubmodelSpec(spec.model, width=width, blocks=kept), device="meta")
            assert kept is None or all(0 <= b < count for b in kept)


def test_an_unknown_model_names_the_known_ones() -> None:
    from nestling.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown model 'resnet999'.*resnet20"):
        family_of("resnet999")
