"""The measured profile: every part timed and metered, totals consistent, RSS agreeing with the meter."""

from __future__ import annotations

import json

import pytest

from nestling.errors import ConfigError
from nestling.models import ModelConfig, build
from nestling.profiler.measure import interleaved_steps, latency_summary, model_parts, profile_model
from nestling.spec import SubmodelSpec


def test_a_profile_covers_every_part_with_latency_and_a_memory_split(tiny_spec: SubmodelSpec) -> None:
    profile = profile_model(tiny_spec, batch=8, repeats=3, warmup=1)
    json.dumps(profile)  # plain JSON
    assert profile["schema"] == "nestling.profile/1"
    assert [p["name"] for p in profile["parts"]] == ["stem", "block0", "block1", "head"]
    for part in profile["parts"]:
        assert part["forward_ms"]["samples"] == 3 and part["forward_ms"]["median"] > 0
        assert part["forward_ms"]["p90"] >= part["forward_ms"]["median"]
        memory = part["memory"]
        assert (
            memory["grads_bytes"] == memory["optimizer_bytes"] > 0
        )  # SGD momentum: one buffer per parameter
        assert memory["training_bytes"] == (
            memory["params_bytes"]
            + memory["grads_bytes"]
            + memory["optimizer_bytes"]
            + memory["activations_bytes"]
        )
    total = profile["total"]
    assert total["peak_training_bytes"] == sum(
        total[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")
    )
    assert total["params_bytes"] == sum(p["memory"]["params_bytes"] for p in profile["parts"])
    # A storage kept by two parts (a block's output, kept by its ReLU and by the next conv) counts once in total.
    assert total["activations_bytes"] <= sum(p["memory"]["activations_bytes"] for p in profile["parts"])


def test_exits_are_parts_of_their_own_and_each_loss_is_charged_to_its_output() -> None:
    spec = SubmodelSpec(ModelConfig("tinycnn", image_size=8, exit_points=(0,)), exits=(0,))
    profile = profile_model(spec, batch=4, repeats=1, warmup=0, rss_check=False)
    assert [p["name"] for p in profile["parts"]] == ["stem", "block0", "exit0", "block1", "head"]
    assert [p.name for p in model_parts(build(spec))] == ["stem", "block0", "exit0", "block1", "head"]


def test_rss_growth_over_a_forward_pass_agrees_with_the_metered_activations() -> None:
    profile = profile_model(SubmodelSpec(ModelConfig("resnet20")), batch=16, repeats=1, warmup=1)
    rss = profile["total"]["rss"]
    assert rss["malloc_returns_memory"]
    # The forward also holds the outputs, the loss and allocator slack: a little above the saved bytes.
    assert 0.9 <= rss["ratio_to_activations"] <= 1.6


def test_latency_summary_reports_median_and_p90_in_milliseconds() -> None:
    summary = latency_summary([0.001 * i for i in range(1, 11)])
    assert summary == {"median": pytest.approx(5.5), "p90": pytest.approx(9.1), "samples": 10}


def test_bad_settings_are_refused(tiny_spec: SubmodelSpec) -> None:
    with pytest.raises(ConfigError, match="batch >= 2"):
        profile_model(tiny_spec, batch=1)


def test_interleaved_steps_time_every_spec_once_per_repeat_and_the_wider_one_is_slower() -> None:
    model = ModelConfig("resnet20", in_channels=1, image_size=16)
    full, narrow = SubmodelSpec.full(model), SubmodelSpec(model, width=0.25)
    wide, small = interleaved_steps([full, narrow], batch=16, repeats=5, warmup=1)
    assert len(wide) == len(small) == 5 and min(wide + small) > 0
    # 16x fewer MACs: slower in turn, whatever the load does between repeats
    assert sorted(w / s for w, s in zip(wide, small))[2] > 1.0


def test_interleaved_steps_refuse_bad_settings(tiny_spec: SubmodelSpec) -> None:
    with pytest.raises(ConfigError, match="specs, batch >= 2"):
        interleaved_steps([], batch=8)
    with pytest.raises(ConfigError, match="repeats >= 1"):
        interleaved_steps([tiny_spec], batch=8, repeats=0)
