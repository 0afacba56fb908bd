"""A board's profile of the fleet's model: measured once, cached in its state folder, measured again only when
the model, batch size, torch version, board, margin or emulated class changes."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from nestling.edge import self_profile
from nestling.edge.emulation import EmulationTarget
from nestling.edge.self_profile import CACHE_NAME, ProfileInputs, board_profile, load_cached, measure_profile
from nestling.models.config import ModelConfig
from nestling.profiler.board_profile import NARROW_WIDTH
from nestling.profiler.catalogue import get_board
from nestling.profiler.measure import interleaved_steps
from nestling.spec import SubmodelSpec

SPEC = SubmodelSpec.full(ModelConfig("tinycnn", image_size=8)).to_dict()


def test_the_first_start_measures_and_a_restart_reads_the_cache(tmp_path: Path) -> None:
    inputs = ProfileInputs(SPEC, 8, "cpu", 0.25)
    cache = tmp_path / CACHE_NAME
    first, measured = board_profile(inputs, cache, repeats=1)
    assert measured and cache.is_file() and first.source == "measured"
    assert first.spec_id == SubmodelSpec.from_dict(SPEC).id and first.batch == 8
    assert first.memory_bytes > 0 and first.gflops > 0 and all(p.forward_s > 0 for p in first.parts)
    assert first.narrow is not None and first.narrow.width == NARROW_WIDTH and first.narrow.step_s > 0
    assert first.task_s is not None and first.task_s >= 0
    again, measured_again = board_profile(inputs, cache, repeats=1)
    assert not measured_again and again == first


@pytest.mark.parametrize(
    "changed",
    [
        ProfileInputs(SubmodelSpec.full(ModelConfig("tinycnn", image_size=16)).to_dict(), 8, "cpu", 0.25),
        ProfileInputs(SPEC, 16, "cpu", 0.25),
        ProfileInputs(SPEC, 8, "cpu", 0.5),
        ProfileInputs(SPEC, 8, "cpu", 0.25, emulate="rpi4"),
    ],
)
def test_any_changed_input_invalidates_the_cache(tmp_path: Path, changed: ProfileInputs) -> None:
    base = ProfileInputs(SPEC, 8, "cpu", 0.25)
    assert changed.key() != base.key()


def test_a_new_torch_or_another_board_invalidates_the_cache(tmp_path: Path, monkeypatch) -> None:
    inputs = ProfileInputs(SPEC, 8, "cpu", 0.25)
    key = inputs.key()
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert inputs.key() != key
    monkeypatch.undo()
    monkeypatch.setattr("nestling.edge.self_profile.cpu_model", lambda: "another board's CPU")
    assert inputs.key() != key


def test_a_stale_or_corrupt_cache_is_measured_again(tmp_path: Path) -> None:
    inputs = ProfileInputs(SPEC, 8, "cpu", 0.25)
    cache = tmp_path / CACHE_NAME
    board_profile(inputs, cache, repeats=1)
    stored = json.loads(cache.read_text())
    stored["profile"]["gflops"] = float("nan")  # tampered with: the same checks as the server's
    cache.write_text(json.dumps(stored).replace("NaN", "1e999"))
    assert load_cached(cache, inputs.key()) is None
    cache.write_text("{not json")
    assert load_cached(cache, inputs.key()) is None
    assert board_profile(inputs, cache, repeats=1)[1]  # measured again, and cached again
    assert load_cached(cache, inputs.key()) is not None


def test_an_emulating_board_reports_its_class_not_this_host(tmp_path: Path) -> None:
    rpi4 = get_board("rpi4")
    target = EmulationTarget.of_board(rpi4)
    inputs = ProfileInputs(SPEC, 8, "cpu", 0.25, emulate="rpi4")
    profile, _ = board_profile(inputs, tmp_path / CACHE_NAME, target)
    assert profile.source == "emulated:rpi4" and profile.gflops == pytest.approx(rpi4.sustained_gflops)
    assert profile.memory_bytes == int(rpi4.memory_budget_bytes * 0.75)


def test_a_cache_made_before_the_narrow_point_is_measured_again(tmp_path: Path, monkeypatch) -> None:
    inputs = ProfileInputs(SPEC, 8, "cpu", 0.25)
    cache = tmp_path / CACHE_NAME
    monkeypatch.setattr(self_profile, "PROFILE_VERSION", self_profile.PROFILE_VERSION - 1)
    old_key = inputs.key()
    monkeypatch.undo()
    assert inputs.key() != old_key  # what a profile holds is part of the key
    board_profile(inputs, cache, repeats=1)
    stored = json.loads(cache.read_text())
    stored["key"], stored["profile"] = old_key, {k: v for k, v in stored["profile"].items() if k != "narrow"}
    cache.write_text(json.dumps(stored))  # as an agent before the narrow point left it
    profile, measured = board_profile(inputs, cache, repeats=1)
    assert measured and profile.narrow is not None


def test_the_narrow_point_predicts_a_real_narrow_and_shallow_member_on_this_host() -> None:
    """NeFL-WD's narrowest ResNet-20 member (2/3 width, 6 of 9 blocks: 30 % of the MACs) at the benchmark's
    batch: its step, timed in turn with the full model's, against the prediction. MAC scaling alone
    predicted it ~40 % short (docs/benchmarks.md); the fixed cost per step the narrow point measured closes it."""
    model = ModelConfig("resnet20", num_classes=10, in_channels=1, image_size=16)
    full = SubmodelSpec.full(model)
    member = SubmodelSpec(model, width=0.67, blocks=(0, 1, 3, 4, 6, 7))
    attempts = []
    # The profile and the member's timing are taken a few seconds apart; a neighbour (the suite's other worker)
    # that starts or stops in between moves one and not the other (31 % off once in CI, 2-6 % alone). The best
    # of three attempts is the host's figure.
    for _ in range(3):
        profile = measure_profile(ProfileInputs(full.to_dict(), 32, "cpu", 0.2), repeats=5, warmup=2)
        wide, narrow = interleaved_steps([full, member], 32, repeats=9, warmup=2)
        # the member's step at the load the profile saw: its ratio to the full step, timed in turn, × that step
        measured = statistics.median(n / w for n, w in zip(narrow, wide)) * profile.step_s
        predicted, by_macs = profile.step_seconds(member), profile.scaled_step_seconds(member)
        attempts.append((abs(predicted - measured) / measured, abs(by_macs - measured) / measured))
        if attempts[-1][0] < 0.2:
            break
    error, by_macs_error = min(attempts)
    assert error < 0.2, attempts
    assert error < by_macs_error, attempts
