"""Device stores flatten to one tensor dict and come back nested exactly as they were."""

from __future__ import annotations

import pytest
import torch

from nestling.edge.procedures.registry import DeviceStore
from nestling.edge.store_state import stores_from_tensors, stores_to_tensors
from nestling.errors import NestlingError


def test_nested_stores_round_trip_with_any_characters_in_names() -> None:
    stores = {
        'dev/1 "odd"': DeviceStore(
            {
                "aux_model_0": {
                    "blocks.0.conv.weight": torch.randn(2, 3),
                    "bn.num_batches_tracked": torch.tensor(5),
                },
                "feddyn_h": {"head.fc.weight": torch.zeros(4)},
            }
        ),
        "dev-2": DeviceStore({"salience": torch.arange(3.0)}),
        "dev-3": DeviceStore(),  # empty: nothing to keep
    }
    back = stores_from_tensors(stores_to_tensors(stores))
    assert set(back) == {'dev/1 "odd"', "dev-2"}
    assert isinstance(back["dev-2"], DeviceStore)
    aux = back['dev/1 "odd"']["aux_model_0"]
    assert torch.equal(
        aux["blocks.0.conv.weight"], stores['dev/1 "odd"']["aux_model_0"]["blocks.0.conv.weight"]
    )
    assert aux["bn.num_batches_tracked"].dtype == torch.int64 and int(aux["bn.num_batches_tracked"]) == 5
    assert torch.equal(back["dev-2"]["salience"], torch.arange(3.0))


def test_state_a_checkpoint_cannot_hold_is_refused_by_name() -> None:
    with pytest.raises(NestlingError, match="rounds.*of type int, not a tensor"):
        stores_to_tensors({"dev-1": DeviceStore({"rounds": 3})})
    with pytest.raises(NestlingError, match="non-string key"):
        stores_to_tensors({"dev-1": DeviceStore({"aux": {0: torch.ones(1)}})})


def test_keys_that_are_not_store_paths_are_refused() -> None:
    with pytest.raises(NestlingError, match="not a JSON path"):
        stores_from_tensors({"dev-1/aux": torch.ones(1)})
    with pytest.raises(NestlingError, match=r"\[device, key"):
        stores_from_tensors({'["dev-1"]': torch.ones(1)})


def test_a_board_store_file_round_trips_and_survives_a_rewrite(tmp_path) -> None:
    from nestling.edge.store_state import load_store_file, save_store_file

    path = tmp_path / "state" / "store.safetensors"
    assert load_store_file(path, "edge/board-1") == {}  # nothing saved yet
    save_store_file(path, DeviceStore({"feddyn_h": {"w": torch.ones(3)}}), "edge/board-1")
    save_store_file(path, DeviceStore({"feddyn_h": {"w": torch.full((3,), 2.0)}}), "edge/board-1")
    assert torch.equal(load_store_file(path, "edge/board-1")["feddyn_h"]["w"], torch.full((3,), 2.0))
    assert [p.name for p in path.parent.iterdir()] == ["store.safetensors"]  # no temp file left


def test_another_boards_or_a_torn_store_file_starts_empty_with_a_warning(tmp_path, caplog) -> None:
    from nestling.edge.store_state import load_store_file, save_store_file

    path = tmp_path / "store.safetensors"
    save_store_file(path, DeviceStore({"salience": torch.ones(2)}), "edge/board-1")
    assert load_store_file(path, "edge/board-2") == {}
    assert "belongs to 'edge/board-1'" in caplog.text
    path.write_bytes(path.read_bytes()[:20])
    assert load_store_file(path, "edge/board-1") == {}
    assert "unreadable" in caplog.text
