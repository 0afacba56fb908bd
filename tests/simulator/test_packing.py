"""State dicts survive the trip to and from worker processes bit for bit (simulator.packing)."""

from __future__ import annotations

import pickle

import torch

from nestling.simulator.packing import pack_state


def test_every_dtype_and_shape_round_trips_in_order() -> None:
    state = {
        "w": torch.randn(4, 3, 3, 3),
        "count": torch.tensor(7, dtype=torch.long),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(5).to(torch.bfloat16),
        "empty": torch.zeros(0, 3),
        "nhwc": torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last),
    }
    back = pickle.loads(pickle.dumps(pack_state(state))).unpack()
    assert list(back) == list(state)
    for key, value in state.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape, key
        assert torch.equal(back[key], value), key
    back["w"].add_(1.0)  # the unpacked tensors are writable
    assert pack_state({}).unpack() == {}
