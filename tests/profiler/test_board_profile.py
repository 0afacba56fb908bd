"""A board's profile summary: the figures an emulating agent reports, what a real measurement gives, and the
server's field-by-field checks (an attacker's hello must be refused with the field named)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from nestling.edge.emulation import EmulatedDevice
from nestling.messages import Task
from nestling.models.config import ModelConfig
from nestling.profiler.board_profile import (
    MAX_GFLOPS,
    MAX_OVERHEAD,
    MAX_PARTS,
    MIN_STEP_S,
    NARROW_WIDTH,
    BoardProfile,
    NarrowFigure,
    ProfileError,
    emulated_board_profile,
    measured_board_profile,
    narrow_spec,
    parse_board_profile,
)
from nestling.profiler.catalogue import get_board
from nestling.profiler.estimator import estimate
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
        # absurd figures that would make every plan predict 0 s (issue 25)
        (lambda d: d.update(gflops=1e6), "gflops"),
        (lambda d: d.update(step_s=1e-9), "step_s"),
        (lambda d: [p.update(forward_s=0.0, backward_s=0.0) for p in d["parts"]], "parts"),
        (lambda d: [p.update(forward_s=1e-12, backward_s=0.0) for p in d["parts"]], "parts"),
        (lambda d: d["parts"][0].update(forward_s=-1.0), "forward_s"),
    ],
)
def test_bad_or_oversized_values_are_refused_naming_the_field(change, field) -> None:
    data = _valid()
    change(data)
    with pytest.raises(ProfileError) as caught:
        parse_board_profile(data)
    assert caught.value.field == field


def test_no_admitted_profile_predicts_a_free_step() -> None:
    """The fastest profile the bounds admit still predicts at least MIN_STEP_S per step for the smallest member."""
    data = _valid()
    data.update(gflops=MAX_GFLOPS, step_s=MIN_STEP_S)
    for part in data["parts"]:
        part.update(forward_s=MIN_STEP_S / len(data["parts"]) / MAX_OVERHEAD, backward_s=0.0)
    fastest = parse_board_profile(data)
    for member in MEMBERS:
        assert fastest.train_seconds(member, 10) >= MIN_STEP_S


def test_a_profile_that_is_not_an_object_is_refused() -> None:
    for data in (None, [], "profile", 3):
        with pytest.raises(ProfileError, match="schema"):
            parse_board_profile(data)


FULL = SubmodelSpec.full(MODEL)
# NeFL-WD-like members: narrow and shallow, narrow only, nearly full, and HeteroFL's narrowest width
MEMBERS = (
    SubmodelSpec(MODEL, width=0.67, blocks=(0, 1, 3, 4, 6, 7)),
    SubmodelSpec(MODEL, width=0.5),
    SubmodelSpec(MODEL, width=0.95),
    SubmodelSpec(MODEL, width=0.0625),
)


def measured_with_narrow(narrow_step_s: float | None) -> BoardProfile:
    """rpi4's figures as if measured, with a narrow point of `narrow_step_s` seconds (None: an older profile)."""
    narrow = None if narrow_step_s is None else NarrowFigure(NARROW_WIDTH, narrow_step_s)
    return dataclasses.replace(rpi4_profile(), source="measured", narrow=narrow)


def test_a_narrow_point_recovers_the_fixed_cost_per_step_it_was_measured_with() -> None:
    plain = measured_with_narrow(None)
    full = plain.step_s
    share = plain.step_seconds(narrow_spec(FULL, NARROW_WIDTH)) / full
    fixed = 0.3 * full  # a board whose step keeps 30 % of the full step however narrow the member
    profile = measured_with_narrow(fixed + (full - fixed) * share)
    assert profile.fixed_step_s(MODEL) == pytest.approx(fixed)
    assert profile.step_seconds(FULL) == pytest.approx(full)  # both measured points are reproduced
    assert profile.step_seconds(narrow_spec(FULL, NARROW_WIDTH)) == pytest.approx(profile.narrow.step_s)
    for spec in MEMBERS:
        scaled = plain.step_seconds(spec)
        assert profile.step_seconds(spec) == pytest.approx(fixed + (full - fixed) * scaled / full)
        assert scaled < profile.step_seconds(spec) < full
    samples = 96
    assert profile.train_seconds(MEMBERS[0], samples) == pytest.approx(
        profile.step_seconds(MEMBERS[0]) * samples / 32
    )


def test_a_task_is_counted_in_whole_steps_and_pays_its_cost_per_task() -> None:
    """100 samples at batch 32 are 4 steps (32, 32, 32, 4): each pays the fixed cost per step, the rest of a
    step is paid per sample; the measured cost per task (building the slice, ...) is added once."""
    plain = measured_with_narrow(None)
    full = plain.step_s
    share = plain.step_seconds(narrow_spec(FULL, NARROW_WIDTH)) / full
    fixed = 0.3 * full
    profile = dataclasses.replace(measured_with_narrow(fixed + (full - fixed) * share), task_s=0.05)
    # 0.05 + 4 x 0.3 full + 100/32 x 0.7 full = 0.05 + 3.3875 full (the old rule: 100/32 = 3.125 full steps)
    assert profile.train_seconds(FULL, 100) == pytest.approx(0.05 + 3.3875 * full)
    assert profile.train_seconds(FULL, 96) == pytest.approx(0.05 + 3 * full)  # whole batches: no difference
    # 2 epochs of 100 samples: 8 steps (profiler.speed.steps_trained), not ceil(200 / 32) = 7
    assert profile.train_seconds(FULL, 200, steps=8) == pytest.approx(
        0.05 + 8 * 0.3 * full + 6.25 * 0.7 * full
    )
    member = MEMBERS[0]
    rest = profile.step_seconds(member) - fixed
    assert profile.train_seconds(member, 100) == pytest.approx(0.05 + 4 * fixed + rest * 100 / 32)
    assert profile.train_seconds(member, 0) == 0.05
    emulated = rpi4_profile()  # no fixed costs: samples x the step per sample, exactly the FLOPs it pads to
    assert emulated.train_seconds(FULL, 100) == pytest.approx(emulated.step_s * 100 / 32, rel=1e-12)


def test_a_cost_per_task_round_trips_and_is_refused_when_wrong() -> None:
    profile = dataclasses.replace(measured_with_narrow(0.01), task_s=0.031)
    data = json.loads(json.dumps(profile.to_dict()))
    assert data["task_s"] == 0.031 and parse_board_profile(data) == profile
    assert (
        "task_s" not in measured_with_narrow(0.01).to_dict()
    )  # older profiles: absent, predicted without it
    for value in (-0.01, math.inf, math.nan, True, "0.03", 1e9):
        with pytest.raises(ProfileError) as caught:
            parse_board_profile({**data, "task_s": value})
        assert caught.value.field == "task_s"
    emulated = {k: v for k, v in data.items() if k != "narrow"} | {"source": "emulated:rpi4"}
    with pytest.raises(ProfileError) as caught:  # an emulation pads the whole task to FLOPs
        parse_board_profile(emulated)
    assert caught.value.field == "task_s"


def test_a_narrow_point_can_neither_undercut_mac_scaling_nor_exceed_the_full_step() -> None:
    plain = measured_with_narrow(None)
    scaled_narrow = plain.step_seconds(narrow_spec(FULL, NARROW_WIDTH))
    faster = measured_with_narrow(0.5 * scaled_narrow)  # faster than its MACs: no fixed cost, the plain rule
    slower = measured_with_narrow(5.0 * plain.step_s)  # slower than the full model: capped at the full step
    assert faster.fixed_step_s(MODEL) == 0.0 and slower.fixed_step_s(MODEL) == pytest.approx(plain.step_s)
    for spec in MEMBERS:
        assert faster.step_seconds(spec) == plain.step_seconds(spec)
        assert slower.step_seconds(spec) == pytest.approx(plain.step_s)


def test_an_older_profile_without_the_narrow_point_is_accepted_and_predicts_by_macs_as_before() -> None:
    data = measured_with_narrow(None).to_dict()
    assert "narrow" not in data  # what boards sent before the field existed
    profile = parse_board_profile(json.loads(json.dumps(data)))
    assert profile.narrow is None and profile.fixed_step_s(MODEL) == 0.0
    full_macs = {p.name: p.forward_macs for p in estimate(FULL, 32).parts}
    figures = {p.name: p.forward_s + p.backward_s for p in profile.parts}
    overhead = profile.step_s / sum(figures.values())
    for spec in MEMBERS:
        by_macs = sum(figures[p.name] * p.forward_macs / full_macs[p.name] for p in estimate(spec, 32).parts)
        assert profile.step_seconds(spec) == pytest.approx(by_macs * overhead, rel=1e-12)


def test_a_profile_with_a_narrow_point_round_trips_through_json() -> None:
    profile = measured_with_narrow(0.01)
    data = json.loads(json.dumps(profile.to_dict()))
    assert data["narrow"] == {"width": NARROW_WIDTH, "step_s": 0.01}
    assert parse_board_profile(data) == profile


def _with_narrow() -> dict:
    return measured_with_narrow(0.01).to_dict()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.update(narrow="fast"), "narrow"),
        (lambda d: d.update(narrow=None), "narrow"),
        (lambda d: d["narrow"].pop("step_s"), "narrow"),
        (lambda d: d["narrow"].update(payload="x"), "narrow"),
        (lambda d: d.update(source="emulated:rpi4"), "narrow"),  # an emulation scales by MACs, exactly
        (lambda d: d["narrow"].update(width=1.0), "narrow.width"),  # the full model is no second point
        (lambda d: d["narrow"].update(width=0.0), "narrow.width"),
        (lambda d: d["narrow"].update(width=math.nan), "narrow.width"),
        (lambda d: d["narrow"].update(width=True), "narrow.width"),
        (lambda d: d["narrow"].update(step_s=math.inf), "narrow.step_s"),
        (lambda d: d["narrow"].update(step_s=-0.01), "narrow.step_s"),
        (lambda d: d["narrow"].update(step_s=0.0), "narrow.step_s"),
        (lambda d: d["narrow"].update(step_s=1e9), "narrow.step_s"),
        (lambda d: d["narrow"].update(step_s="0.01"), "narrow.step_s"),
    ],
)
def test_a_bad_narrow_point_is_refused_naming_the_field(change, field) -> None:
    data = _with_narrow()
    change(data)
    with pytest.raises(ProfileError) as caught:
        parse_board_profile(data)
    assert caught.value.field == field
