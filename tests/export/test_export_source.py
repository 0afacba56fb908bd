"""Re-opening checkpoints: the strategy rebuilt from its manifest; submodels by name, level or spec."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nestling.errors import ConfigError, SpecError
from nestling.export.source import context_from_manifest, open_checkpoint, select_target
from nestling.models import ModelConfig
from nestling.spec import SubmodelSpec


def test_targets_carry_each_nefl_submodels_own_bn_and_steps(nefl_checkpoint: Path) -> None:
    source = open_checkpoint(nefl_checkpoint.parent)  # a checkpoints folder resolves to its newest round
    assert source.path == nefl_checkpoint and source.method == "nefl-wd" and source.dataset == "cifar10"
    k1, k2 = source.targets()[:2]
    step = "blocks.0.step"
    assert float(k1.state[step]) != float(k2.state[step])
    assert select_target(source, level=2).name == "k2"
    assert select_target(source, submodel=k2.spec.id).name == "k2"
    with pytest.raises(ConfigError, match="exactly one"):
        select_target(source, submodel="k1", level=1)
    with pytest.raises(ConfigError, match="--level must be 1..5"):
        select_target(source, level=6)


def test_a_spec_must_belong_to_the_checkpoints_model(nefl_checkpoint: Path) -> None:
    source = open_checkpoint(nefl_checkpoint)
    target = select_target(source, spec=SubmodelSpec(source.strategy.model, width=0.5, blocks=(0, 4, 8)))
    assert target.spec.width == 0.5 and target.state["stem.conv.weight"].shape[0] == 8
    with pytest.raises(SpecError, match="not the checkpoint's model"):
        select_target(source, spec=SubmodelSpec(ModelConfig("resnet20", num_classes=100)))


def test_manifests_without_a_context_fall_back_to_the_model(nefl_checkpoint: Path, tmp_path: Path) -> None:
    old = tmp_path / "round-000000"
    shutil.copytree(nefl_checkpoint, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["context"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    ctx = context_from_manifest(manifest)
    assert (ctx.arch, ctx.num_classes, ctx.image_size, ctx.dataset) == ("resnet20", 10, 32, None)
    assert [t.name for t in open_checkpoint(old).targets()] == ["k1", "k2", "k3", "k4", "k5"]
