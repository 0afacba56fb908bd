"""Re-opening checkpoints through their self-described deployables; submodels by name, level or spec."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from nestling.errors import ConfigError, SpecError
from nestling.export.source import open_checkpoint, select_target
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
    target = select_target(source, spec=SubmodelSpec(source.model, width=0.5, blocks=(0, 4, 8)))
    assert target.spec.width == 0.5 and target.state["stem.conv.weight"].shape[0] == 8
    with pytest.raises(SpecError, match="not the checkpoint's model"):
        select_target(source, spec=SubmodelSpec(ModelConfig("resnet20", num_classes=100)))


def test_a_checkpoint_that_does_not_describe_its_submodels_says_how_to_upgrade(
    nefl_checkpoint: Path, tmp_path: Path
) -> None:
    """Checkpoints written before deployables were described: a named error, then the upgrade command fixes it."""
    from nestling.cli import main

    old = tmp_path / "run" / "checkpoints" / "round-000000"
    shutil.copytree(nefl_checkpoint, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["deployables"], manifest["sides"]["deployables"], manifest["context"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    (old / "deployables.safetensors").unlink()
    with pytest.raises(ConfigError, match="nestling upgrade-checkpoint"):
        open_checkpoint(old)
    assert main(["upgrade-checkpoint", str(tmp_path / "run")]) == 0
    upgraded, original = open_checkpoint(tmp_path / "run"), open_checkpoint(nefl_checkpoint)
    assert [t.name for t in upgraded.targets()] == ["k1", "k2", "k3", "k4", "k5"]
    for mine, theirs in zip(upgraded.targets(), original.targets(), strict=True):
        assert mine.spec == theirs.spec and mine.state.keys() == theirs.state.keys()
        assert all(torch.equal(mine.state[k], theirs.state[k]) for k in theirs.state)
