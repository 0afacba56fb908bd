"""The replay report: four readable PNGs and an index.html showing them, from metrics and timeline files."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from nestling.simulator.replay_report import class_outcomes, gantt_round, round_spans, write_replay_report


def event(round_index: int, device: str, cls: str, start: float, end: float, outcome: str) -> dict:
    third = (end - start) / 3
    return {
        "round": round_index,
        "device_id": device,
        "spec_id": "s",
        "dispatched_at": start,
        "ends_at": end,
        "outcome": outcome,
        "down_s": third,
        "compute_s": third,
        "up_s": third,
        "device_class": cls,
    }


TIMELINE = [
    event(0, "d0", "rpi4", 0.0, 40.0, "used"),
    event(0, "d1", "phone-mid", 0.0, 90.0, "used"),
    event(0, "d2", "phone-mid", 0.0, 150.0, "cancelled"),
    event(1, "d0", "rpi4", 90.0, 130.0, "used"),
    event(1, "d2", "phone-mid", 90.0, 100.0, "dropped"),
    event(1, "d3", "laptop", 90.0, 200.0, "used"),
]
METRICS = [
    {
        "round": 0,
        "virtual_time": 90.0,
        "submodels": [{"name": "k1", "accuracy": 0.3}, {"name": "k2", "accuracy": 0.35}],
    },
    {
        "round": 1,
        "virtual_time": 200.0,
        "submodels": [{"name": "k1", "accuracy": 0.5}, {"name": "k2", "accuracy": 0.6}],
    },
]


def write_run(out: Path) -> None:
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS))
    (out / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TIMELINE))


def test_rounds_span_first_dispatch_to_close() -> None:
    assert round_spans(METRICS, TIMELINE) == {0: (0.0, 90.0), 1: (90.0, 200.0)}


def test_outcomes_per_class_count_tasks_fleet_and_contributors() -> None:
    table = class_outcomes(TIMELINE, {"rpi4": 3, "phone-mid": 2, "laptop": 1, "rpi5": 4})
    assert table["phone-mid"]["used"] == 1 and table["phone-mid"]["dropped"] == 1
    assert table["phone-mid"]["cancelled"] == 1 and table["phone-mid"]["contributors"] == 1
    assert table["rpi4"]["contributors"] == 1 and table["rpi4"]["devices"] == 3
    assert table["rpi5"]["devices"] == 4 and sum(table["rpi5"].values()) == 4  # in the fleet, never picked


def test_the_gantt_shows_the_round_with_the_most_dropouts() -> None:
    assert gantt_round(TIMELINE) == 1
    assert gantt_round([]) is None


def test_report_folder_has_four_pngs_and_an_index_showing_them(tmp_path: Path) -> None:
    out = tmp_path / "run"
    write_run(out)
    index = write_replay_report(out, "fedavg · tinycnn", {"rpi4": 1, "phone-mid": 2, "laptop": 1})
    names = ["accuracy_time.png", "round_durations.png", "participation.png", "gantt.png"]
    page = index.read_text()
    for name in names:
        with Image.open(out / "report" / name) as image:
            assert image.width >= 600 and image.height >= 300
        assert f"src='{name}'" in page
    assert "2 rounds" in page and "<td>phone-mid</td><td>2</td><td>1</td><td>3</td>" in page
