"""Exit heads are objects a method registers under the name its checkpoints carry; the kernel knows only "linear"."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import nestling.methods  # noqa: F401  (the methods' heads, as every layer that builds models has them)
from nestling.errors import ConfigError
from nestling.models import ModelConfig, build
from nestling.models.heads import (
    ExitHead,
    PoolClassifier,
    exit_head,
    register_exit_head,
    registered_exit_heads,
    unregister_exit_head,
)
from nestling.plugins import load_plugins
from nestling.spec import SubmodelSpec


def test_the_methods_register_their_heads_under_the_names_checkpoints_carry() -> None:
    assert {"linear", "scalefl", "depthfl", "fedepth"} <= set(registered_exit_heads())
    for kind in ("linear", "scalefl", "depthfl", "fedepth"):
        assert exit_head(kind).name == kind


def test_without_the_methods_layer_the_kernel_knows_linear_only_and_says_where_the_rest_come_from() -> None:
    code = textwrap.dedent(
        """
        from nestling.errors import ConfigError
        from nestling.models import ModelConfig, build
        from nestling.models.heads import registered_exit_heads
        from nestling.spec import SubmodelSpec
        assert list(registered_exit_heads()) == ["linear"], registered_exit_heads()
        spec = SubmodelSpec(ModelConfig("tinycnn", exit_points=(1,), exit_kind="scalefl"), exits=(1,))
        try:
            build(spec, device="meta")
            raise SystemExit("built an unregistered exit kind")
        except ConfigError as exc:
            assert "import nestling.methods" in str(exc), exc
        import nestling.methods
        assert len(build(spec, device="meta").exits["1"].body) == 12
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("exits", [(1,), ()])
def test_an_unknown_kind_is_refused_at_build_naming_the_known_ones(exits: tuple[int, ...]) -> None:
    spec = SubmodelSpec(ModelConfig("tinycnn", exit_points=(1,), exit_kind="scalfl"), exits=exits)
    with pytest.raises(ConfigError, match=r"unknown exit_kind 'scalfl' \(known: linear, .*scalefl"):
        build(spec, device="meta")


@pytest.mark.parametrize("kind", [3, "", None, ["scalefl"]])
def test_an_exit_kind_that_is_not_a_name_is_refused_when_the_config_is_made(kind: object) -> None:
    with pytest.raises(ConfigError, match="exit_kind must be the name of an exit head"):
        ModelConfig("tinycnn", exit_kind=kind)  # type: ignore[arg-type]


def test_registration_refuses_a_second_head_of_one_name_and_what_is_not_a_head() -> None:
    with pytest.raises(ConfigError, match="'scalefl' is registered twice"):
        register_exit_head("scalefl")(ExitHead)
    with pytest.raises(ConfigError, match="must return an ExitHead"):
        register_exit_head("not-a-head")(nn.Identity)  # type: ignore[type-var]
    assert "not-a-head" not in registered_exit_heads()
    with pytest.raises(ConfigError, match="non-empty name"):
        register_exit_head("")


PLUGIN = '''
"""A plugin's exit head: BN → ReLU → max-pool → linear, folded by its own export hook."""

import torch
import torch.nn.functional as F
from torch import nn

from nestling.models.heads import ExitHead, register_exit_head


class MaxPoolExit(nn.Module):
    def __init__(self, ctx, global_channels):
        super().__init__()
        self.norm = ctx.norm(global_channels)
        self.fc = ctx.classifier(global_channels)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_max_pool2d(F.relu(self.norm(x)), 1), 1))


class Folded(nn.Module):
    def __init__(self, pre, fc):
        super().__init__()
        self.pre, self.fc = pre, fc

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_max_pool2d(self.pre(x), 1), 1))


@register_exit_head("{name}")
class MaxPoolExitHead(ExitHead):
    def build(self, ctx, global_channels, final_channels, *, preact):
        return MaxPoolExit(ctx, global_channels)

    def standalone(self, part, kit):
        if not isinstance(part, MaxPoolExit):
            return None
        return Folded(kit.pre_activation(part.norm), kit.plain_linear(part.fc))
'''


def test_a_plugin_registers_an_exit_head_that_builds_trains_and_exports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nestling.export.standalone import build_standalone, plan_outputs, reference_outputs

    name = f"maxpool-{tmp_path.name}"
    module = f"exit_plugin_{abs(hash(tmp_path.name))}"
    (tmp_path / f"{module}.py").write_text(PLUGIN.replace("{name}", name))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        load_plugins(module)
        spec = SubmodelSpec(
            ModelConfig("resnet20", image_size=8, exit_points=(2,), exit_kind=name), width=0.5, exits=(2,)
        )
        net = build(spec)
        assert type(net.exits["2"]).__name__ == "MaxPoolExit"
        assert not isinstance(net.exits["2"], PoolClassifier)
        outputs = net(torch.randn(4, 3, 8, 8))
        sum(o.sum() for o in outputs).backward()
        assert net.exits["2"].fc.weight.grad is not None
        net.eval()
        plan = plan_outputs(net, all_exits=True)
        x = torch.randn(2, 3, 8, 8)
        with torch.no_grad():
            for got, expected in zip(build_standalone(net, plan)(x), reference_outputs(net, plan, x)):
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    finally:
        unregister_exit_head(name)
    assert name not in registered_exit_heads()
