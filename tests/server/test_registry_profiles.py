"""Hellos that carry a measured profile: a valid one reaches the strategies, a bad one is refused as
`bad_profile` naming the field (tested as an attacker would send it, through the real wire codec)."""

from __future__ import annotations

import math

import pytest

from nestling.errors import WireError
from nestling.models.config import ModelConfig
from nestling.profiler.board_profile import MAX_PARTS, emulated_board_profile
from nestling.server.registry import DeviceRegistry
from nestling.spec import SubmodelSpec
from nestling.wire.fleet_messages import CONTROL_BYTES, decode_hello, encode_hello

MODEL = ModelConfig("resnet20", in_channels=1, image_size=16)


def summary() -> dict:
    return emulated_board_profile(SubmodelSpec.full(MODEL), 32, 9.6, 2**31, "rpi4").to_dict()


def over_the_wire(profile: dict) -> dict:
    return decode_hello(encode_hello("b", profile))[1]


def test_a_valid_profile_becomes_the_devices_board() -> None:
    registry = DeviceRegistry()
    info = registry.register("b", over_the_wire({"num_samples": 5, "board_profile": summary()}), now=0.0)
    assert (
        info.board is not None and info.board.source == "emulated:rpi4" and info.board.memory_bytes == 2**31
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("memory_bytes", 2**80),  # huge but finite
        ("gflops", math.nan),  # NaN travels as null (JSON has no NaN)
        ("gflops", 1e308),
        ("batch", "32"),
        ("parts", "all of them"),
        ("source", "measured!"),
    ],
)
def test_bad_profile_values_are_refused_naming_the_field(field: str, value: object) -> None:
    data = summary()
    data[field] = value
    registry = DeviceRegistry()
    with pytest.raises(WireError) as caught:
        registry.register("b", over_the_wire({"num_samples": 5, "board_profile": data}), now=0.0)
    assert caught.value.reason == "bad_profile" and f"board_profile.{field}" in str(caught.value)
    assert not registry.known("b")


def test_too_many_parts_are_refused_and_the_largest_valid_profile_fits_a_control_frame() -> None:
    data = summary()
    part = data["parts"][1]
    data["parts"] = [{**part, "name": f"block{i}"} for i in range(MAX_PARTS)]
    data["step_s"] = sum(p["forward_s"] + p["backward_s"] for p in data["parts"])  # the step its parts make
    data["source"], data["narrow"] = "measured", {"width": 0.25, "step_s": 3599.999999}  # a measured board's
    data["task_s"] = 3599.999999
    assert len(encode_hello("b", {"num_samples": 5, "board_profile": data})) < CONTROL_BYTES
    DeviceRegistry().register("b", over_the_wire({"num_samples": 5, "board_profile": data}), now=0.0)
    data["parts"].append({**part, "name": "block999"})
    with pytest.raises(WireError, match=r"board_profile\.parts"):
        DeviceRegistry().register("b", over_the_wire({"num_samples": 5, "board_profile": data}), now=0.0)


def test_a_board_still_measuring_is_not_counted_until_it_has_its_profile() -> None:
    registry = DeviceRegistry()
    registry.register("b", {"num_samples": 5, "profiling": True}, now=0.0)
    assert registry.available() == []
    registry.register("b", {"num_samples": 5, "profiling": False, "board_profile": summary()}, now=1.0)
    assert [d.device_id for d in registry.available()] == ["b"]
    with pytest.raises(WireError, match="profiling"):
        registry.register("c", {"num_samples": 5, "profiling": "yes"}, now=0.0)
