"""Atomic round checkpoints: the newest *complete* one is found; leftovers and corrupt files are skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nestling.errors import ConfigError
from nestling.server.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_checkpoint_side,
    save_checkpoint,
)


def tensors(value: float) -> dict[str, torch.Tensor]:
    return {"global/w": torch.full((3, 2), value), "global/n": torch.tensor(4)}


def test_save_then_load_round_trips_tensors_and_manifest(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 7, tensors(1.5), {"method": "fedavg", "seed": 3})
    assert path.name == "round-000007" and latest_checkpoint(tmp_path) == path
    loaded, manifest = load_checkpoint(path)
    assert torch.equal(loaded["global/w"], tensors(1.5)["global/w"]) and int(loaded["global/n"]) == 4
    assert manifest["round"] == 7 and manifest["method"] == "fedavg" and manifest["seed"] == 3
    assert len(manifest["weights_sha256"]) == 64


def test_the_newest_complete_checkpoint_wins_and_old_ones_are_pruned(tmp_path: Path) -> None:
    for r in range(5):
        save_checkpoint(tmp_path, r, tensors(float(r)), {}, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-000002", "round-000003", "round-000004"]
    assert latest_checkpoint(tmp_path).name == "round-000004"


def test_a_temp_directory_left_by_a_crash_is_ignored(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, tensors(1.0), {})
    leftover = tmp_path / ".round-000002.tmp-12345"
    leftover.mkdir()
    (leftover / "global.safetensors").write_bytes(b"half written")
    assert latest_checkpoint(tmp_path).name == "round-000001"
    save_checkpoint(tmp_path, 2, tensors(2.0), {})  # and a later save of that round still succeeds
    assert latest_checkpoint(tmp_path).name == "round-000002"


def test_a_corrupted_weights_file_is_skipped_for_the_previous_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, tensors(1.0), {})
    newest = save_checkpoint(tmp_path, 2, tensors(2.0), {})
    weights = newest / "global.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert latest_checkpoint(tmp_path).name == "round-000001"


def test_side_tensor_sets_round_trip_and_a_checkpoint_without_one_says_none(tmp_path: Path) -> None:
    stores = {'["dev-1", "h", "w"]': torch.arange(6.0).reshape(2, 3)}
    path = save_checkpoint(tmp_path, 1, tensors(1.0), {}, sides={"device_stores": stores})
    assert torch.equal(
        load_checkpoint_side(path, "device_stores")['["dev-1", "h", "w"]'], torch.arange(6.0).reshape(2, 3)
    )
    assert load_checkpoint_side(path, "other") is None
    with pytest.raises(ConfigError, match="identifier"):
        save_checkpoint(tmp_path, 2, tensors(2.0), {}, sides={"../escape": stores})


def test_a_checkpoint_whose_side_file_is_damaged_is_skipped(tmp_path: Path) -> None:
    side = {"device_stores": {'["dev-1", "h"]': torch.ones(4)}}
    save_checkpoint(tmp_path, 1, tensors(1.0), {}, sides=side)
    newest = save_checkpoint(tmp_path, 2, tensors(2.0), {}, sides=side)
    (newest / "device_stores.safetensors").write_bytes(b"torn")
    assert latest_checkpoint(tmp_path).name == "round-000001"
    with pytest.raises(ConfigError, match="device_stores.safetensors"):
        load_checkpoint_side(newest, "device_stores")


@pytest.mark.parametrize("damage", ["no_manifest", "bad_json", "no_weights"])
def test_incomplete_checkpoints_are_skipped(tmp_path: Path, damage: str) -> None:
    save_checkpoint(tmp_path, 1, tensors(1.0), {})
    newest = save_checkpoint(tmp_path, 2, tensors(2.0), {})
    if damage == "no_manifest":
        (newest / "manifest.json").unlink()
    elif damage == "bad_json":
        (newest / "manifest.json").write_text("{ not json")
    else:
        (newest / "global.safetensors").unlink()
    assert latest_checkpoint(tmp_path).name == "round-000001"


def test_no_checkpoint_at_all_gives_none(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None


def test_loading_a_checkpoint_of_another_format_is_a_clear_error(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 1, tensors(1.0), {})
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="format 99"):
        load_checkpoint(path)
    with pytest.raises(ConfigError, match="no manifest.json"):
        load_checkpoint(tmp_path / "round-000042")


def test_strategy_state_refuses_a_checkpoint_of_another_model(make_ctx, tmp_path: Path) -> None:
    from nestling.server.strategies import create_strategy

    small = create_strategy("fedavg", make_ctx())
    path = save_checkpoint(tmp_path, 0, small.state_tensors(), {})
    loaded, _ = load_checkpoint(path)
    large = create_strategy("fedavg", make_ctx(num_classes=7))
    with pytest.raises(ConfigError, match="does not match the fedavg model at tensor 'head.fc"):
        large.load_state(loaded, {})
    fresh = create_strategy("fedavg", make_ctx(seed=9))
    fresh.load_state(loaded, {})
    assert all(torch.equal(fresh.global_state[k], small.global_state[k]) for k in small.global_state)
