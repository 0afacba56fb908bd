"""benchmarks/dynamicfl.py runs end to end in --quick mode and prints its one-line verdict last; it trains at least
two local epochs (with one, the structure reported is not the one trained) and reports what each class trained."""

from __future__ import annotations

import pytest

from benchmarks.dynamicfl import main, trained_structures
from tests.benchmarks.quick_run import run_benchmark, run_script_help


@pytest.mark.slow
def test_quick_mode_prints_the_verdict_line() -> None:
    last = run_benchmark("dynamicfl", "--quick")[-1]
    figures = dict(item.split("=", 1) for item in last.split())
    assert {"dynamicfl_acc", "fedavg_acc", "gain_by_capacity", "time_ratio_by_capacity"} <= set(figures)
    assert figures["gain_by"] == "single-class" and int(figures["local_epochs"]) >= 2
    gains = [float(g) for g in figures["gain_by_capacity"].split("/")]
    assert len(gains) == 3 and gains[0] == 0.0  # capacity 0 everywhere is FedAvg bit for bit
    assert [float(e) for e in figures["expanded_by_capacity"].split("/")] == [0.0, 1.0, 2.0]
    ratios = [float(r) for r in figures["time_ratio_by_capacity"].split("/")]
    assert ratios[0] == 1.0 and ratios[2] > 1.0  # expanded convs cost time


def test_one_local_epoch_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--local-epochs", "1"])
    assert stopped.value.code == 2
    assert "structure reported is not the one trained" in capsys.readouterr().err


def test_the_trained_structure_is_read_per_capacity_class() -> None:
    summary = {
        "method_report": {
            "dynamicfl": {
                "classes": {
                    "c0": {"boards": 1, "expanded_sites": {}, "structures": {"a": {}}},
                    "c2": {
                        "boards": 2,
                        "expanded_sites": {"stem.conv": 2, "blocks.0.conv1": 1},
                        "structures": {"b": {"stem.conv": ["kxk"], "blocks.0.conv1": ["kxk"]}, "c": None},
                    },
                }
            }
        }
    }
    assert trained_structures(summary) == {0: (0.0, {}), 2: (1.0, {"stem.conv": 2, "blocks.0.conv1": 1})}


def test_help_runs_as_a_script() -> None:
    assert "--quick" in run_script_help("dynamicfl")
