"""Self-describing checkpoints: for every method, what export reads back is exactly what the strategy evaluates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nestling.checkpoint_io import DEPLOYABLES, load_checkpoint_side, read_manifest
from nestling.export.source import open_checkpoint, spec_target
from nestling.server.checkpoint import save_strategy_checkpoint
from nestling.server.strategies import STRATEGIES, StrategyContext, create_strategy
from nestling.slicing import extract
from nestling.spec import SubmodelSpec


def _trained_looking(method: str) -> object:
    """A strategy whose every stored tensor is random, so any mix-up between submodels shows."""
    strategy = create_strategy(
        method,
        StrategyContext(
            arch="resnet20",
            num_classes=10,
            in_channels=3,
            image_size=16,
            num_clients=8,
            total_rounds=2,
            seed=0,
        ),
    )
    generator = torch.Generator().manual_seed(7)
    tensors = strategy.state_tensors()
    noisy = {
        key: (torch.rand(value.shape, generator=generator) + 0.5).to(value.dtype)
        if value.is_floating_point()
        else value
        for key, value in tensors.items()
    }
    strategy.load_state(noisy, strategy.state_meta())
    return strategy


@pytest.mark.parametrize("method", sorted(STRATEGIES))
def test_every_method_exports_what_it_evaluates(method: str, tmp_path: Path) -> None:
    strategy = _trained_looking(method)
    folder = save_strategy_checkpoint(tmp_path, 0, strategy, seed=0)  # type: ignore[arg-type]
    source = open_checkpoint(folder)
    expected = strategy.eval_targets()  # type: ignore[attr-defined]
    assert [t.name for t in source.targets()] == [t.name for t in expected]
    for read, wanted in zip(source.targets(), expected, strict=True):
        assert read.spec == wanted.spec and read.spec.id == wanted.spec.id
        assert (read.ensemble, read.static_bn, read.active_width) == (
            wanted.ensemble,
            wanted.static_bn,
            wanted.active_width,
        )
        assert read.state.keys() == wanted.state.keys()
        for key, value in wanted.state.items():
            assert read.state[key].dtype == value.dtype and torch.equal(read.state[key], value), (method, key)
    assert source.model == strategy.model  # type: ignore[attr-defined]
    full = SubmodelSpec(source.model, width=0.5) if source.model.arch == "resnet20" else None
    if full is not None and method in ("fedavg", "heterofl", "fjord"):
        base = strategy.global_export_state()  # type: ignore[attr-defined]
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                spec_target(source, full).state.values(), extract(base, full).values(), strict=True
            )
        )


def test_sliced_submodels_are_stored_once(tmp_path: Path) -> None:
    """HeteroFL's widths are slices of the full model: the checkpoint keeps no per-width copies."""
    strategy = _trained_looking("heterofl")
    folder = save_strategy_checkpoint(tmp_path, 0, strategy, seed=0)  # type: ignore[arg-type]
    record = read_manifest(folder)[DEPLOYABLES]
    assert all(entry["overlay"] == [] for entry in record["targets"])
    side = load_checkpoint_side(folder, DEPLOYABLES)
    assert side is not None and all(key.startswith("base/") for key in side)
