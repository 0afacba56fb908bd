"""Numbers print one way everywhere: percent with one decimal, the worst/avg summary.json holds."""

from __future__ import annotations

import math

import pytest

from nestling.numbers import headline, mebibytes, percent, seconds
from nestling.progress import print_submodel_table

SUMMARY = {
    "method": "nefl-wd",
    "model": "tinycnn",
    "dataset": "digits",
    "rounds": 2,
    "worst_accuracy": 0.10027855153203342,
    "avg_accuracy": 0.5164,
    "wall_seconds": 12.0,
    "train_seconds": 3.0,
    "trained_by": {"s1": ["board-0"]},
    "transport": {"accepted": 8, "dispatched": 8},
    "config": {"run": {"deadline_s": 30.0}},
    "submodels": [
        {
            "id": "s1",
            "name": "k1",
            "accuracy": 0.10027855153203342,
            "loss": 2.3,
            "parameters": 10,
            "macs": 20,
        },
        {"id": "s2", "name": "k2", "accuracy": 0.93252, "loss": 0.3, "parameters": 30, "macs": 40},
    ],
    "plans": {
        "board-0": {
            "spec": "s1",
            "specs": ["s1"],
            "reason": "time",
            "memory_bytes": 17_616_000,
            "budget_bytes": 128 * 1024 * 1024,
            "time_budget_s": 21.0,
            "predicted_s_median": 4.2,
            "observed_s_median": 4.0,
            "replans": 0,
        }
    },
}


def test_formats() -> None:
    assert percent(0.51234) == "51.2%" and percent(None) == "–" and percent(math.nan) == "–"
    assert mebibytes(16.8 * 1024 * 1024) == "16.8" and seconds(0.416) == "0.42"
    assert headline(SUMMARY) == "worst 10.0%, average 51.6%"


def test_the_run_table_prints_summary_figures(capsys: pytest.CaptureFixture[str]) -> None:
    print_submodel_table(SUMMARY)
    out = capsys.readouterr().out
    assert "worst 10.0%, average 51.6%" in out and "93.3%" in out
    assert "0.1002" not in out and "10.03%" not in out


def test_the_demo_shows_budget_deadline_prediction_and_what_each_board_trained(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from nestling.server.fleet_demo import print_table

    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: rich would fold the table's cells otherwise

    print_table(SUMMARY)
    out = capsys.readouterr().out
    assert "worst 10.0%, average 51.6%" in out  # summary.json's, not a recomputed figure
    assert "16.8 / 128.0" in out  # the plan's memory against the board's budget
    assert "21.00" in out and "4.20" in out  # training time allowed by the deadline; predicted
    assert "round deadline 30.00 s" in out
    assert "board-0" in out and "k1" in out
