"""docs/extending.md's board example runs as written; register_board refuses figures that describe no device."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nestling.errors import ConfigError
from nestling.profiler.catalogue import BOARDS, get_board, register_board, unregister_board

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "extending.md"


def _board_blocks() -> list[str]:
    text = GUIDE.read_text()
    start = text.index("## Adding a board")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start : end if end != -1 else len(text)], flags=re.S)


@pytest.fixture
def namespace() -> Iterator[dict[str, Any]]:
    scope: dict[str, Any] = {}
    yield scope
    unregister_board("rock5b")


def test_the_board_example_registers_a_class_that_emulation_and_traces_use(namespace: dict[str, Any]) -> None:
    blocks = _board_blocks()
    assert len(blocks) == 2
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), namespace)
    board = get_board("rock5b")
    assert board.peak_gflops_fp32 == pytest.approx(182.4)
    assert namespace["target"].memory_bytes == board.memory_budget_bytes
    fleet = namespace["fleet"]
    assert sum(trace.device_class == "rock5b" for trace in fleet) == 5  # exact class proportions
    register_board(board)  # the same record again (a re-imported plugin) is harmless


@pytest.mark.parametrize(
    "change, field",
    [
        ({"name": "Rock 5B"}, "name"),
        ({"kind": "toaster"}, "kind"),
        ({"compute_unit": "npu"}, "compute_unit"),
        ({"peak_gflops_fp32": float("inf")}, "peak_gflops_fp32"),
        ({"ram_bytes": -1}, "ram_bytes"),
        ({"memory_budget_bytes": 10**15}, "memory_budget_bytes"),
        ({"utilisation": 3.0}, "utilisation"),
        ({"sources": ()}, "source"),
    ],
)
def test_register_board_names_what_is_wrong(change: dict[str, Any], field: str) -> None:
    bad = dataclasses.replace(get_board("rpi4"), **{"name": "test-board", **change})
    with pytest.raises(ConfigError, match=field):
        register_board(bad)
    assert "test-board" not in BOARDS


def test_shipped_classes_cannot_be_replaced_or_removed() -> None:
    with pytest.raises(ConfigError, match="already in the catalogue"):
        register_board(dataclasses.replace(get_board("rpi4"), power_w=1.0))
    with pytest.raises(ConfigError, match="ships with Nestling"):
        unregister_board("rpi4")


def test_a_plugin_named_in_the_environment_is_loaded_by_the_command_line(tmp_path: Path) -> None:
    plugin = tmp_path / "rock_plugin.py"
    plugin.write_text(_board_blocks()[0])
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "nestling",
            "traces",
            "generate",
            "--fleet",
            "rock5b:1",
            "--devices",
            "3",
            "--out",
            str(tmp_path / "f.jsonl"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NESTLING_PLUGINS": "rock_plugin", "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "f.jsonl").read_text().count('"rock5b"') == 3
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "nestling",
            "traces",
            "generate",
            "--devices",
            "1",
            "--out",
            str(tmp_path / "g.jsonl"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NESTLING_PLUGINS": "no_such_plugin"},
    )
    assert missing.returncode == 2 and "cannot import plugin module 'no_such_plugin'" in missing.stderr
