"""A run's progress is never silent: a line per round with the time left when output is not a terminal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from nestling.progress import RoundProgress, clock_time


@dataclass
class Record:
    round: int
    submodels: list[dict[str, Any]] = field(default_factory=list)
    train_loss: float | None = 0.5


def test_not_a_terminal_prints_a_line_per_round_with_time_left(capsys: pytest.CaptureFixture[str]) -> None:
    with RoundProgress(4, title="fedavg · tinycnn") as progress:
        progress.update(Record(0, [{"accuracy": 0.5}, {"accuracy": 0.25}]))
        progress.update(Record(1))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("fedavg · tinycnn: round 1/4") and "worst 25.0%  avg 37.5%" in lines[0]
    assert "left 0:00:0" in lines[0] and "elapsed" in lines[0]
    assert "round 2/4" in lines[1] and "loss 0.500" in lines[1]


def test_quiet_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with RoundProgress(2, enabled=False) as progress:
        progress.update(Record(0))
    assert capsys.readouterr().out == ""


def test_clock_time() -> None:
    assert clock_time(3725.4) == "1:02:05" and clock_time(0) == "0:00:00"
