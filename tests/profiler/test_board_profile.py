"""A board's profile summary: the figures an emulating agent reports, what a real measurement gives, and the
server's field-by-field checks (an attacker's hello must be refused with the field named)."""

from __future__ import annotations

import json
import math

import pytest

from nestling.edge.emulation import EmulatedDevice
from nestling.messages import Task
from nestling.models.config import ModelConfig
from nestling.profiler.board_profile import (
    MAX_PARTS,
    ProfileError,
    emulated_board_profile,
    measured_board_profile,
    parse_board_profile,
)
from nestling.profiler.catalogue import get_board
from nestling.profiler.measure import profile_model
from nestling.profiler.speed import MacCounter, samples_trained, task_training_flops
from nestling.spec import SubmodelSpec

MODEL = ModelConfig("resnet20", num_classes=10, in_channels=1, image_size=16)


def rpi4_profile():
    board = get_board("rpi4")
    return emulated_board_profile(
        SubmodelSpec.full(MODEL), 32, board.sustained_gflops, board.memory_budget_bytes, "rpi4"
    )


def test_an_emulated_board_predicts_exactly_what_its_emulation_pads_to() -> None:
    profile = rpi4_profile()
    hparams = {"batch_size": 32, "local_epochs": 2}
    device = EmulatedDevice(get_board("rpi4"))
    macs = MacCounter((1, 16, 16))
    for width in (0.3, 0.7, 1.0):
        spec = SubmodelSpec(MODEL, width=width)
        task = Task(0, "b", spec.to_dict(), {}, "sgd", hparams)
        # what TaskPacer.compute pads this task to on an emulated rpi4
        padded = device.compute_seconds(task_training_flops(task, 100, macs))
        assert profile.train_seconds(spec, samples_trained(hparams, 100)) == pytest.approx(padded, rel=1e-9)
    smaller = profile.train_seconds(SubmodelSpec(MODEL, width=0.5, blocks=(0, 1, 3, 4, 6, 7)), 64)
    assert 0 < smaller < profile.train_seconds(SubmodelSpec.full(MODEL), 64) / 3


def test_a_measured_profile_summarises_profile_model_and_predicts_its_own_step() -> None:
    spec = SubmodelSpec.full(ModelConfig("tinycnn", image_size=8))
    measured = profile_model(spec, 8, repeats=2, warmup=1, rss_check=False)
    profile = measured_board_profile(measured, 40.0, 10**9, margin=0.25)
    assert profile.memory_bytes == 750_000_000 and profile.source == "measured"
    assert [p.name for p in profile.parts] == [p["name"] for p in measured["parts"]]
    assert profile.step_seconds(spec) == pytest.approx(profile.step_s)  # the full model is what it measured
    assert parse_board_profile(json.loads(json.dumps(profile.to_dict()))) == profile


def test_a_profile_round_trips_through_json_and_stays_small() -> None:
    profile = rpi4_profile()
    text = json.dumps(profile.to_dict())
    assert parse_board_profile(json.loads(text)) == profile
    assert len(text) < 4000


def _valid() -> dict:
    return rpi4_profile().to_dict()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.update(memory_bytes=10**30), "memory_bytes"),  # huge but finite
        (lambda d: d.update(memory_bytes=1e300), "memory_bytes"),  # a float where bytes are counted
        (lambda d: d.update(gflops=math.nan), "gflops"),
        (lambda d: d.update(gflops=math.inf), "gflops"),
        (lambda d: d.update(step_s=-1.0), "step_s"),
        (lambda d: d.update(batch="32"), "batch"),
        (lambda d: d.update(batch=True), "batch"),
        (lambda d: d.update(margin=2.0), "margin"),
        (lambda d: d.update(schema="nestling.board_profile/9"), "schema"),
        (lambda d: d.update(source="trust me"), "source"),
        (lambda d: d.update(spec_id="x" * 500), "spec_id"),
        (lambda d: d.update(extra="payload"), "extra"),
        (lambda d: d.update(parts=d["parts"] * (MAX_PARTS // len(d["parts"]) + 1)), "parts"),
        (lambda d: d.update(parts=[]), "parts"),
        (lambda d: d.update(parts=d["parts"] + d["parts"][:1]), "parts"),
        (lambda d: d["parts"][0].update(name="../../etc"), "parts[0].name"),
        (lambda d: d["parts"][1].update(forward_s=1e9), "forward_s"),
        (lambda d: d["parts"][1].update(activation_bytes=-5), "activation_bytes"),
        (lambda d: d["parts"][1].pop("backward_s"), "parts[1]"),
    ],
)
def test_bad_or_oversized_values_are_refused_naming_the_field(change, field) -> None:
    data = _valid()
    change(data)
    with pytest.raises(ProfileError) as caught:
        parse_board_profile(data)
    assert caught.value.field == field


def test_a_profile_that_is_not_an_object_is_refused() -> None:
    for data in (None, [], "profile", 3):
        with pytest.raises(ProfileError, match="schema"):
            parse_board_profile(data)
