"""A `nestling server` start that fails (no broker) or would land on another run leaves the run folder exactly
as it was: no metrics deleted, no run.json rewritten, no folder made."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from nestling.server.broker import find_free_port
from nestling.server.fleet import server_main
from tests.server.fleet_harness import fleet_toml


def fake_run(out: Path, rounds_done: int) -> None:
    """A fleet run's files (contents are never read on these paths, only kept)."""
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"round": r}) + "\n" for r in range(rounds_done)))
    (out / "run.json").write_text('{"schema": "nestling.run/1"}')
    (out / "registry.json").write_text('{"indices": {"dev-0": 0}}')
    (out / "summary.json").write_text(json.dumps({"rounds": rounds_done}))


def fingerprint(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def config_without_broker(tmp_path: Path, out_dir: str = "out") -> Path:
    config = tmp_path / "fleet.toml"
    url = f"mqtt://127.0.0.1:{find_free_port()}"  # nothing listens there
    config.write_text(fleet_toml(url, "nobroker", devices=2, rounds=5, out_dir=out_dir))
    return config


@pytest.mark.parametrize("flags", [[], ["--resume"], ["--overwrite"]])
def test_a_failed_start_keeps_the_run(
    flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_run(tmp_path / "out", rounds_done=3)
    before = fingerprint(tmp_path / "out")
    assert server_main(["--config", str(config_without_broker(tmp_path)), *flags]) == 2
    err = capsys.readouterr().err
    assert ("already holds a run" in err) if not flags else ("cannot reach MQTT broker" in err), err
    assert fingerprint(tmp_path / "out") == before


def test_a_failed_start_makes_no_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert server_main(["--config", str(config_without_broker(tmp_path, "fresh"))]) == 2
    assert "cannot reach MQTT broker" in capsys.readouterr().err
    assert not (tmp_path / "fresh").exists()


def test_resume_and_overwrite_together_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = config_without_broker(tmp_path)
    assert server_main(["--config", str(config), "--resume", "--overwrite"]) == 2
    assert "give one" in capsys.readouterr().err


def test_resuming_a_finished_fleet_run_changes_nothing_and_needs_no_broker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nestling.cli import main

    out = tmp_path / "out"
    tiny = [
        "--model",
        "tinycnn",
        "--dataset",
        "digits",
        "--clients",
        "2",
        "--rounds",
        "2",
        "--local-steps",
        "1",
    ]
    assert (
        main(["simulate", "--method", "nefl-wd", *tiny, "--workers", "1", "--quiet", "--out", str(out)]) == 0
    )
    config = tmp_path / "fleet.toml"
    url = f"mqtt://127.0.0.1:{find_free_port()}"  # nothing listens: a finished run must not need it
    config.write_text(fleet_toml(url, "done", devices=2, rounds=2, out_dir="out"))
    capsys.readouterr()
    before = fingerprint(out)
    assert server_main(["--config", str(config), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "nothing to resume" in printed and "done: 2 rounds, worst " in printed and "%, average " in printed
    assert fingerprint(out) == before


def test_resume_with_no_run_yet_starts_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The systemd unit always passes --resume: its first start has no run folder and must start one (here it
    then stops at the missing broker, having made no folder)."""
    assert server_main(["--config", str(config_without_broker(tmp_path, "first")), "--resume"]) == 2
    captured = capsys.readouterr()
    assert "no run in" in captured.out and "cannot reach MQTT broker" in captured.err
    assert not (tmp_path / "first").exists()
