"""Parameter roles are declared where a module builds its tensors; a tensor's name never decides its role."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nestling.errors import SpecError
from nestling.models import ModelConfig, build
from nestling.models.blocks import BasicBlock, EncoderBlock, PreActBlock
from nestling.models.layers import SlimBatchNorm2d, SlimLayerNorm, is_running_statistic
from nestling.models.roles import LAYER_NORM, NORM, STEP, WEIGHT, declare_role, roles_of
from nestling.slicing import roles_for
from nestling.spec import SubmodelSpec


class Gated(nn.Module):
    """A step size called `gain` (declared) beside a weight called `step_bias` (undeclared)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))
        self.step_bias = nn.Parameter(torch.zeros(3))
        declare_role(self, STEP, "gain")


def test_an_undeclared_tensor_named_step_is_a_weight_and_a_declared_one_of_any_name_is_a_step() -> None:
    net = nn.Sequential(Gated(), nn.Linear(3, 2))
    assert roles_of(net) == {"0.gain": STEP, "0.step_bias": WEIGHT, "1.weight": WEIGHT, "1.bias": WEIGHT}


def test_a_tensor_renamed_without_its_declaration_is_an_error_not_a_weight() -> None:
    module = Gated()
    module.renamed = module.gain  # the rename: `gain` is gone, its declaration stays
    del module.gain
    with pytest.raises(SpecError, match=r"Gated at 'the root' declares roles for \['gain'\]"):
        roles_of(module)


@pytest.mark.parametrize("role", ["steps", "", None, 3])
def test_an_unknown_role_is_refused(role: object) -> None:
    with pytest.raises(ValueError, match="unknown parameter role"):
        declare_role(nn.Linear(2, 2), role, "weight")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", "fc.weight", 3])
def test_a_declaration_names_one_of_the_modules_own_tensors(name: object) -> None:
    with pytest.raises(ValueError, match="by name"):
        declare_role(nn.Linear(2, 2), STEP, name)  # type: ignore[arg-type]


def _spec(arch: str, **model: object) -> SubmodelSpec:
    extra = {"dim": 16, "depth": 2, "heads": 2, "mlp_dim": 32} if arch == "vit" else {}
    return SubmodelSpec(ModelConfig(arch, image_size=8, extra=extra, **model), width=0.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["resnet20", "preresnet20", "tinycnn", "vit"])
def test_every_family_declares_its_step_sizes_and_norms(arch: str) -> None:
    """What each module class is, and which tensors it holds, decides the role: the declarations cover them."""
    spec = _spec(arch)
    net = build(spec, device="meta")
    roles = roles_for(spec)
    expected: dict[str, str] = {}
    for name, module in net.named_modules():
        if isinstance(module, (BasicBlock, PreActBlock)) and not module.skipped:
            expected[f"{name}.step"] = STEP
        if isinstance(module, EncoderBlock) and not module.skipped:
            expected.update({f"{name}.step_sa": STEP, f"{name}.step_ffn": STEP})
        if isinstance(module, SlimBatchNorm2d):
            expected.update({f"{name}.{key}": NORM for key in module.state_dict()})
        if isinstance(module, SlimLayerNorm):
            expected.update({f"{name}.weight": LAYER_NORM, f"{name}.bias": LAYER_NORM})
    assert {k: r for k, r in roles.items() if r != WEIGHT} == expected
    assert set(roles) == set(net.state_dict())
    assert any(r == STEP for r in roles.values())


@pytest.mark.parametrize("norm_stats", ["running", "per_width", "batch"])
def test_the_statistic_predicate_matches_exactly_the_norm_buffers_every_model_holds(norm_stats: str) -> None:
    """Key-only code (packing, screening, the statistics cohort) tells running statistics by name; this holds
    that name rule to the buffers the norms actually register, including FjORD's per-width sets."""
    levels = (0.25, 0.5, 1.0) if norm_stats == "per_width" else ()
    spec = _spec("resnet20", norm_stats=norm_stats, width_levels=levels)
    net = build(spec, device="meta")
    buffers = {
        f"{name}.{key}"
        for name, module in net.named_modules()
        if isinstance(module, SlimBatchNorm2d)
        for key, _ in module.named_buffers(recurse=False)
    }
    assert {k for k in net.state_dict() if is_running_statistic(k)} == buffers
    assert (norm_stats == "batch") == (not buffers)
