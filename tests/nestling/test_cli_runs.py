"""What an operator types never loses a run: a taken --out is refused, a failed start or a typo leaves no
folder and changes nothing, a finished run resumed is a no-op, a damaged newest checkpoint is named."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest

from nestling.cli import main

TINY = [
    "--model", "tinycnn", "--dataset", "synthetic", "--clients", "4", "--fraction", "0.5",
    "--rounds", "2", "--local-steps", "2", "--workers", "1", "--eval-every", "1",
    "--limit-train", "200", "--limit-test", "100", "--quiet",
]  # fmt: skip


def fingerprint(folder: Path) -> dict[str, str]:
    """Every file under `folder` with its sha256: equal fingerprints mean nothing was changed."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished two-round nefl-wd run, shared (tests copy it before touching it)."""
    out = tmp_path_factory.mktemp("runs") / "nefl"
    assert main(["simulate", "--method", "nefl-wd", *TINY, "--out", str(out)]) == 0
    return out


@pytest.fixture
def run_copy(finished_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "nefl"
    shutil.copytree(finished_run, copy)
    return copy


def test_out_onto_an_existing_run_is_refused_and_changes_nothing(
    run_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = fingerprint(run_copy)
    code = main(["simulate", "--method", "fedavg", *TINY, "--out", str(run_copy)])
    err = capsys.readouterr().err
    assert code == 2
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert fingerprint(run_copy) == before


def test_overwrite_replaces_the_whole_run(run_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run_copy / "notes.txt").write_text("mine")  # not a run file: --overwrite leaves it
    code = main(["simulate", "--method", "fedavg", *TINY, "--out", str(run_copy), "--overwrite"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((run_copy / "summary.json").read_text())
    assert summary["method"] == "fedavg"
    for checkpoint in (run_copy / "checkpoints").iterdir():  # no nefl-wd checkpoint is left to resume from
        assert json.loads((checkpoint / "manifest.json").read_text())["method"] == "fedavg"
    assert (run_copy / "notes.txt").read_text() == "mine"


def test_resuming_a_finished_run_changes_nothing(run_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = fingerprint(run_copy)
    assert main(["simulate", "--resume", str(run_copy), "--quiet"]) == 0
    assert "nothing to resume" in capsys.readouterr().out
    assert fingerprint(run_copy) == before  # wall_seconds included


def test_a_run_failing_validation_leaves_no_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "typo"
    assert main(["simulate", "--method", "nefl-xx", *TINY, "--out", str(out)]) == 2
    assert "unknown method 'nefl-xx'" in capsys.readouterr().err
    assert not out.exists()


def test_a_failed_start_on_an_existing_run_changes_nothing(
    run_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = fingerprint(run_copy)
    code = main(["simulate", "--method", "nefl-xx", *TINY, "--out", str(run_copy), "--overwrite"])
    assert code == 2 and "nefl-xx" in capsys.readouterr().err
    assert fingerprint(run_copy) == before


def test_resume_needs_a_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--resume", str(tmp_path / "nothing")]) == 2
    assert "no such run folder" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()


def test_damaged_newest_checkpoint_is_named_before_the_fallback(
    run_copy: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    newest = sorted((run_copy / "checkpoints").iterdir())[-1]
    weights = newest / "global.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with caplog.at_level(logging.WARNING, logger="nestling.checkpoint"):
        assert main(["simulate", "--resume", str(run_copy), "--quiet"]) == 0, capsys.readouterr().err
    warnings = [r.getMessage() for r in caplog.records if r.name == "nestling.checkpoint"]
    assert any(newest.name in message and "sha256" in message for message in warnings), warnings
    lines = (run_copy / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [0, 1]  # round 2 was trained again


def test_export_names_a_damaged_newest_checkpoint(
    run_copy: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from nestling.checkpoint_io import resolve_checkpoint

    newest = sorted((run_copy / "checkpoints").iterdir())[-1]
    (newest / "manifest.json").write_text("{")
    with caplog.at_level(logging.WARNING, logger="nestling.checkpoint"):
        chosen = resolve_checkpoint(run_copy)
    assert chosen != newest
    assert any(newest.name in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records)


def test_another_method_leaves_the_files_options_behind_with_a_note(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """README Quickstart's second command: examples/simulate.toml holds NeFL's `flex`; HeteroFL has none."""
    from nestling.cli import options_left_behind

    example = Path(__file__).resolve().parents[2] / "examples" / "simulate.toml"
    assert options_left_behind(example, "heterofl") == ("method.flex",)
    assert "flex" in capsys.readouterr().err
    assert options_left_behind(example, "nefl-wd") == ()  # the file's own method keeps its options
    assert options_left_behind(example, None) == ()
