"""The inbound schema: strict types, bounds (1e999 included), sizes, and unknown fields refused by name."""

from __future__ import annotations

import math

import pytest

from nestling.errors import WireError
from nestling.wire.schemas import chunk_layout, hello_profile, result_meta, status_resources


def test_a_hello_keeps_only_what_it_said_and_drops_nulls() -> None:
    profile = hello_profile({"num_samples": 5, "tier": None, "labels": [3, 1], "export": {"on_finish": True}})
    assert profile == {"num_samples": 5, "labels": [3, 1], "export": {"on_finish": True}}
    assert "tier" not in profile  # a null tier is no tier: strategies test `"tier" in profile`


@pytest.mark.parametrize(
    ("profile", "named"),
    [
        ({"num_samples": "5"}, r"\$\.num_samples"),
        ({"num_samples": True}, r"\$\.num_samples"),
        ({"num_samples": 10**400}, r"\$\.num_samples"),
        ({"num_samples": 1, "tier": "abc"}, r"\$\.tier"),
        ({"num_samples": 1, "tier": [1]}, r"\$\.tier"),
        ({"num_samples": 1, "tier": -100}, r"\$\.tier"),
        ({"num_samples": 1, "tier": math.inf}, r"\$\.tier"),
        ({"num_samples": 1, "budget": "lots"}, r"\$\.budget"),
        ({"num_samples": 1, "budget": {"memory_bytes": math.inf}}, r"\$\.budget\.memory_bytes"),
        ({"num_samples": 1, "budget": {"macs": 0}}, r"\$\.budget\.macs"),
        ({"num_samples": 1, "emulating": {"class": "x", "gflops": 1e6}}, r"\$\.emulating\.gflops"),
        ({"num_samples": 1, "device_class": "jetson-orin"}, r"unknown field `device_class`"),
        ({"num_samples": 1, "export": {"on_finish": True, "format": "pickle"}}, r"\$\.export\.format"),
        ({"num_samples": 1, "labels": list(range(100_001))}, r"\$\.labels"),
    ],
)
def test_a_bad_hello_is_refused_naming_the_field(profile: dict, named: str) -> None:
    with pytest.raises(WireError, match=named) as caught:
        hello_profile(profile)
    assert caught.value.reason == "bad_hello"


def _meta(**metrics: object) -> dict:
    return {"task_id": "t", "session": "s", "num_samples": 3, "metrics": metrics}


def test_a_result_keeps_known_metrics_typed_and_a_plugins_scalars() -> None:
    meta, metrics = result_meta(_meta(train_seconds=2, loss_mean=None, steps=4, my_plugin_score=0.5))
    assert meta.model_id == "global" and meta.num_samples == 3
    assert metrics == {"train_seconds": 2.0, "loss_mean": None, "steps": 4, "my_plugin_score": 0.5}


@pytest.mark.parametrize(
    ("metrics", "named"),
    [
        ({"train_seconds": "fast"}, r"train_seconds"),
        ({"loss_mean": "low"}, r"loss_mean"),
        ({"loss_mean": math.inf}, r"loss_mean"),
        ({"steps": -1}, r"steps"),
        ({"untouched": "all"}, r"untouched"),
        ({"Not A Name": 1}, r"extras"),
        ({"plugin": [1, 2]}, r"extras"),
        ({f"m{i}": 1 for i in range(33)}, r"extras"),
    ],
)
def test_a_bad_metric_is_refused(metrics: dict, named: str) -> None:
    with pytest.raises(WireError, match=named) as caught:
        result_meta(_meta(**metrics))
    assert caught.value.reason == "bad_result"


def test_result_meta_and_status_refuse_unknown_fields() -> None:
    with pytest.raises(WireError, match="unknown field `weight_override`"):
        result_meta({**_meta(), "weight_override": 100})
    with pytest.raises(WireError, match="unknown field `gpu_load`"):
        status_resources({"cpu_percent": 3.0, "gpu_load": 1})
    with pytest.raises(WireError, match=r"\$\.cpu_percent"):
        status_resources({"cpu_percent": math.inf})


def test_a_chunk_layout_is_typed() -> None:
    good = {"transfer_id": "t-1", "index": 0, "count": 1, "chunk_size": 1024, "total_length": 10}
    good["payload_sha256"] = "0" * 64
    assert chunk_layout(good).count == 1
    for name, value in (("transfer_id", ["x"]), ("count", 10**400), ("index", "0"), ("payload_sha256", "z")):
        with pytest.raises(WireError, match=name) as caught:
            chunk_layout({**good, name: value})
        assert caught.value.reason == "bad_chunk"
