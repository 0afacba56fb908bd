"""A board's DynamicFL state survives a record, a device store and a safetensors file unchanged."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nestling.edge.procedures.registry import DeviceStore
from nestling.edge.store_state import stores_from_tensors, stores_to_tensors
from nestling.methods.dynamicfl.dbb import ORIGINAL
from nestling.methods.dynamicfl.state import DynamicState


def _state() -> DynamicState:
    state = DynamicState(
        round=3,
        capacity=2,
        structure={"blocks.0.conv1": ("conv1x1", ORIGINAL)},
        global_salience={"blocks.0.conv1": -0.25, "stem.conv": 1e-9},
        branches={"blocks.0.conv1": {"branches.conv1x1.conv.weight": torch.randn(4, 4, 1, 1)}},
    )
    state.remember_local(2, {"stem.conv": 0.5})
    state.remember_local(3, {"stem.conv": 0.125, "blocks.0.conv1": 3.0})
    return state


def _same(a: DynamicState, b: DynamicState) -> None:
    assert (a.round, a.capacity, a.structure, a.history_rounds) == (
        b.round,
        b.capacity,
        b.structure,
        b.history_rounds,
    )
    assert (a.local_salience, a.global_salience, a.history) == (
        b.local_salience,
        b.global_salience,
        b.history,
    )
    assert a.branches.keys() == b.branches.keys()
    for site in a.branches:
        assert a.branches[site].keys() == b.branches[site].keys()
        assert all(torch.equal(a.branches[site][k], b.branches[site][k]) for k in a.branches[site])


def test_record_round_trip_keeps_everything_exactly() -> None:
    state = _state()
    tensors, metadata = state.to_record()
    assert json.loads(json.dumps(metadata)) == metadata
    assert math.isnan(float(tensors["salience.history"][0, 0]))  # blocks.0.conv1 not measured in round 2
    _same(DynamicState.from_record(tensors, metadata), state)


def test_a_fresh_state_round_trips_too() -> None:
    fresh = DynamicState()
    assert not fresh.started
    _same(DynamicState.from_store(fresh.to_store()), fresh)


def test_state_goes_through_a_device_store_file(tmp_path: Path) -> None:
    state = _state()
    stores = {"board-7": DeviceStore(dynamicfl=state.to_store())}
    path = tmp_path / "state.safetensors"
    save_file(stores_to_tensors(stores), str(path))
    loaded = stores_from_tensors(load_file(str(path)))
    _same(DynamicState.from_store(loaded["board-7"]["dynamicfl"]), state)


def test_bad_records_are_refused_by_name() -> None:
    tensors, metadata = _state().to_record()
    with pytest.raises(ValueError, match="schema 9 is not 1"):
        DynamicState.from_record(tensors, {**metadata, "schema": 9})
    with pytest.raises(ValueError, match="missing 'salience.local'"):
        DynamicState.from_record({k: v for k, v in tensors.items() if k != "salience.local"}, metadata)
    with pytest.raises(ValueError, match="outside the structure"):
        DynamicState.from_record(tensors, {**metadata, "structure": {}})
    with pytest.raises(ValueError, match="entries for 2 sites"):
        DynamicState.from_record({**tensors, "salience.global": torch.zeros(5)}, metadata)
    with pytest.raises(ValueError, match="'meta' is not JSON"):
        DynamicState.from_store({"meta": torch.tensor([255], dtype=torch.uint8), "tensors": tensors})
    with pytest.raises(ValueError, match="missing 'tensors'"):
        DynamicState.from_store({"meta": torch.zeros(1, dtype=torch.uint8)})
