"""`nestling profile` writes a complete profile quickly; `nestling plan` turns five profiles into a table and JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nestling.profiler.cli import profile_main
from nestling.server.plan_cli import plan_main

MIB = 2**20


@pytest.fixture(scope="module")
def resnet20_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    started = time.perf_counter()
    assert profile_main(["--model", "resnet20", "--batch", "32", "--name", "board-0", "--out", str(out)]) == 0
    assert time.perf_counter() - started < 120  # the bound for this CPU
    return out


def test_profile_of_resnet20_at_batch_32_is_complete(resnet20_profile: Path) -> None:
    profile = json.loads(resnet20_profile.read_text())
    assert profile["schema"] == "nestling.profile/1" and profile["name"] == "board-0"
    assert {"cpu", "memory", "gpu", "compute", "jetson"} <= set(profile["device"])
    assert profile["model"]["batch"] == 32 and profile["model"]["arch"] == "resnet20"
    assert [p["name"] for p in profile["parts"]] == ["stem", *[f"block{i}" for i in range(9)], "head"]
    assert profile["total"]["rss"]["forward_delta_bytes"] > 0


def five_profiles(base: Path, tmp_path: Path) -> list[str]:
    profile = json.loads(base.read_text())
    paths = []
    for i, mb in enumerate((10, 20, 35, 60, 120)):
        path = tmp_path / f"board-{i}.json"
        path.write_text(json.dumps({**profile, "name": f"board-{i}", "budget": {"memory_bytes": mb * MIB}}))
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("method", ["nefl-wd", "heterofl", "fjord", "scalefl", "fedepth"])
def test_plan_on_five_profiles_prints_a_table_and_writes_json(
    method: str, resnet20_profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    model = "preresnet20" if method == "fedepth" else "resnet20"
    assert (
        plan_main(
            [
                *five_profiles(resnet20_profile, tmp_path),
                "--method",
                method,
                "--model",
                model,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    plan = json.loads(out.read_text())
    assert plan["method"] == method and plan["batch"] == 32
    rows = plan["devices"]
    assert [r["device"] for r in rows] == [f"board-{i}" for i in range(5)]
    for row in rows:
        assert {"label", "spec", "training_macs", "memory_bytes", "step_ms", "fits"} <= set(row)
        assert row["step_ms"] is not None  # from the measured profile
    memory = [r["memory_bytes"] for r in rows]
    assert memory == sorted(memory)  # more budget never buys a smaller plan
    assert rows[-1]["fits"]
    printed = capsys.readouterr().out
    assert "board-4" in printed and "GMACs/step" in printed


def test_plan_from_bare_budgets_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert (
        plan_main(
            ["--budget-mb", "12", "200", "--method", "m-fedepth", "--model", "preresnet20", "--out", str(out)]
        )
        == 0
    )
    rows = json.loads(out.read_text())["devices"]
    assert rows[1]["detail"]["models"] == 2 and rows[0]["detail"]["models"] == 1
    assert plan_main(["--method", "fedepth", "--model", "preresnet20", "--out", str(out)]) == 2
    assert "no devices" in capsys.readouterr().out
    assert profile_main(["--spec", str(tmp_path / "missing.json")]) == 2
