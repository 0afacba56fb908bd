"""Run summaries: each board's accuracy on the submodel it deploys, for every method the same way."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from nestling.server.run_report import board_accuracy
from nestling.server.strategies import DeviceInfo, StrategyContext, create_strategy


@dataclass
class Scored:
    name: str
    spec_id: str
    accuracy: float


def test_each_board_scores_its_deployed_submodel_with_quartiles_over_boards() -> None:
    strategy = create_strategy(
        "heterofl",
        StrategyContext(
            arch="tinycnn", num_classes=4, in_channels=3, image_size=8, num_clients=4, total_rounds=2
        ),
    )
    devices = [DeviceInfo(f"d{i}", i, 10) for i in range(4)]
    targets = strategy.eval_targets()
    scores = {t.spec.id: Scored(t.name, t.spec.id, 0.1 * (k + 1)) for k, t in enumerate(targets)}
    report = board_accuracy(strategy, devices, list(scores.values()), last_round=1)
    assert report is not None
    deployed = {d.device_id: scores[strategy.deploy_spec(d, 1).id] for d in devices}
    assert {d: b["submodel"] for d, b in report["boards"].items()} == {d: s.name for d, s in deployed.items()}
    values = sorted(s.accuracy for s in deployed.values())
    assert report["mean"] == pytest.approx(sum(values) / 4)
    assert report["q1"] <= report["median"] <= report["q3"] and report["iqr"] == pytest.approx(
        report["q3"] - report["q1"]
    )
    partial = board_accuracy(strategy, devices, [scores[targets[-1].spec.id]], last_round=1)
    assert partial is not None and partial["unevaluated"] == sum(
        strategy.deploy_spec(d, 1).id != targets[-1].spec.id for d in devices
    )
    assert board_accuracy(strategy, devices, [], last_round=1) is None


def test_worst_accuracy_is_the_smallest_submodels_not_the_lowest_score() -> None:
    """METHODS' worst is what the weakest board deploys: early in training a larger submodel can score lower."""
    from nestling.server.run_report import summarise

    submodels = [
        {"spec_id": "a", "name": "full", "accuracy": 0.40, "loss": 1.0, "parameters": 270_000, "macs": 40},
        {"spec_id": "b", "name": "half", "accuracy": 0.55, "loss": 1.0, "parameters": 70_000, "macs": 10},
        {"spec_id": "c", "name": "half-b", "accuracy": 0.60, "loss": 1.0, "parameters": 70_000, "macs": 12},
    ]
    record = {
        "submodels": submodels,
        "collect_seconds": 1.0,
        "virtual_time": 0.0,
        "bytes_down": 0,
        "bytes_up": 0,
    }
    config = {"method": {"name": "nefl-wd"}, "model": {"arch": "resnet20"}, "data": {"dataset": "digits"}}
    summary = summarise([record], config, wall_seconds=2.0)
    assert summary["worst_accuracy"] == 0.55  # fewest parameters, then fewest MACs
    assert summary["avg_accuracy"] == pytest.approx((0.40 + 0.55 + 0.60) / 3)
