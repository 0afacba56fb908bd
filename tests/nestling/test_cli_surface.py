"""The command line's surface: every option explains itself, numbers are checked where they are typed,
`--version` is listed, and a closed pipe (`nestling -h | head`) ends quietly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nestling.cli import EXTERNAL_COMMANDS, main

VERBS = {"traces": [["traces", "generate"], ["traces", "import"]]}


def help_text(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--help"])
    assert exit_info.value.code == 0, args
    return capsys.readouterr().out


def options_without_help(text: str) -> list[str]:
    """Option lines of an argparse help page with no description on their line or the next."""
    lines = text.splitlines()
    missing = []
    for index, line in enumerate(lines):
        if not line.startswith("  -"):
            continue
        has_own = "  " in line.strip()  # flags, then two spaces, then the description
        following = lines[index + 1] if index + 1 < len(lines) else ""
        continued = following.startswith(" " * 6)  # a description wrapped onto the next line
        if not has_own and not continued:
            missing.append(line.strip())
    return missing


@pytest.mark.parametrize("command", ["simulate", "demo", *EXTERNAL_COMMANDS])
def test_every_option_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    for args in VERBS.get(command, [[command]]):
        assert options_without_help(help_text(capsys, args)) == [], args


def test_traces_help_lists_its_verbs(capsys: pytest.CaptureFixture[str]) -> None:
    out = help_text(capsys, ["traces"])
    assert "generate" in out and "import" in out


def test_top_level_help_lists_version_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--version" in out and "simulate" in out


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--budget-mb", "-5", "--method", "nefl-wd", "--model", "tinycnn"],
        ["plan", "--budget-mb", "nan", "--method", "nefl-wd", "--model", "tinycnn"],
        ["plan", "--fleet", "x", "--train-share", "1.5"],
        ["profile", "--batch", "0"],
        ["profile", "--repeats", "-1"],
        ["demo", "--rounds", "-1"],
        ["demo", "--lr", "inf"],
        ["export", "--checkpoint", "x", "--threads", "0"],
        ["infer", "--bundle", "x", "y.npy", "--top", "0"],
        ["traces", "generate", "--devices", "-2", "--fleet", "rpi4:1", "--out", "x.jsonl"],
        ["broker", "--port", "-1"],
    ],
)
def test_invalid_numbers_are_refused_where_typed(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "must be" in err, err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--rounds", "0"], "rounds must be >= 1"),
        (["--fraction", "-0.5"], "fraction must be in (0, 1]"),
        (["--lr", "nan"], "lr must be a finite number > 0"),
        (["--local-steps", "0"], "local_steps must be >= 1"),
        (["--seed", "-1"], "seed must be >= 0"),
        (["--weight-decay", "-1"], "weight_decay must be a finite number >= 0"),
    ],
)
def test_simulate_refuses_invalid_numbers_in_one_line(
    args: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """simulate's numbers are checked by the config (so a TOML file gets the same errors), before any folder."""
    out = tmp_path / "run"
    assert main(["simulate", *args, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()


@pytest.mark.parametrize("args", [["-h"], ["--version"], ["traces", "--help"]])
def test_a_closed_pipe_ends_quietly(args: list[str]) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (`head`) is gone before anything is written
    try:
        done = subprocess.run(
            [sys.executable, "-m", "nestling.cli", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
