"""DynamicFL as users run it: capacities from budgets or tiers, plain uploads, structures that persist and resume."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from nestling.config import config_from_dict
from nestling.messages import Result, Task
from nestling.methods.dynamicfl import affordable_capacity
from nestling.profiler.estimator import training_memory
from nestling.server.checkpoint import latest_checkpoint, load_checkpoint
from nestling.server.strategies import DeviceInfo, StrategyContext, create_strategy
from nestling.simulator.run import run_simulation


def _config(method: str, *, rounds: int = 3, momentum: float = 0.9, **options: Any) -> Any:
    return config_from_dict(
        {
            "run": {"rounds": rounds, "seed": 5, "workers": 1, "eval_every": 0},
            "data": {"dataset": "synthetic", "clients": 6, "limit_train": 144, "limit_test": 24},
            "model": {"arch": "resnet20"},
            "method": {"name": method, **options},
            "train": {"fraction": 1.0, "local_epochs": 2, "batch_size": 12, "momentum": momentum},
        }
    )


def _final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    state, _ = load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))
    return {k: v for k, v in state.items() if k.startswith("global/")}


def test_all_capacities_zero_is_fedavg_bit_for_bit(tmp_path: Path) -> None:
    """METHODS §5.b.8, with momentum and two epochs (the optimiser must survive the epoch boundary)."""
    run_simulation(_config("fedavg"), tmp_path / "fedavg")
    run_simulation(_config("dynamicfl", capacities=[0]), tmp_path / "dynamicfl")
    fedavg, dynamic = _final_state(tmp_path / "fedavg"), _final_state(tmp_path / "dynamicfl")
    assert fedavg.keys() == dynamic.keys()
    assert all(torch.equal(fedavg[k], dynamic[k]) for k in fedavg)


@pytest.mark.parametrize("protocol", ["paper", "released"])
def test_boards_with_capacity_expand_and_upload_the_plain_model(protocol: str, tmp_path: Path) -> None:
    summary = run_simulation(_config("dynamicfl", rounds=2, protocol=protocol), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        by_class = record["method"]["dynamicfl"]
        assert by_class["c0"]["expanded"] == 0 and by_class["c0"]["boards"] == 2
        assert by_class["c1"]["expanded"] == 2 and by_class["c2"]["expanded"] == 4  # two boards per tier
        assert record["accepted"] == 6  # plain uploads pass the server's shape and key checks
    classes = summary["method_report"]["dynamicfl"]["classes"]
    assert sorted(classes) == ["c0", "c1", "c2"]
    assert all(len(s) == 2 for s in classes["c2"]["structures"].values())
    assert all(s == {} for s in classes["c0"]["structures"].values())
    plain = create_strategy("fedavg", _strategy_ctx())
    assert {k.removeprefix("global/") for k in _final_state(tmp_path)} == set(plain.global_state)


def test_a_resumed_run_keeps_each_boards_structure(tmp_path: Path) -> None:
    """The structure ζ_i and salience live in the device store, which simulator checkpoints carry."""
    cfg = _config("dynamicfl", rounds=2)
    straight = run_simulation(cfg, tmp_path / "straight")

    class Stop(Exception):
        pass

    def stop_after_round_0(record: Any) -> None:
        if record.round == 0:
            raise Stop

    with pytest.raises(Stop):
        run_simulation(cfg, tmp_path / "resumed", on_round=stop_after_round_0)
    resumed = run_simulation(cfg, tmp_path / "resumed", resume=True)
    a, b = _final_state(tmp_path / "straight"), _final_state(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert straight["method_report"] == resumed["method_report"]


def _strategy_ctx(**options: Any) -> StrategyContext:
    return StrategyContext(
        arch="resnet20",
        num_classes=10,
        in_channels=3,
        image_size=32,
        num_clients=9,
        total_rounds=4,
        local={"batch_size": 32, "momentum": 0.0},
        options=options,
    )


def test_capacity_follows_the_registered_budget_and_never_exceeds_it() -> None:
    strategy = create_strategy("dynamicfl", _strategy_ctx())
    plain = training_memory(strategy.full_spec, 32, momentum=False)
    device = DeviceInfo("d", index=0, num_samples=10, memory_budget_bytes=plain - 1)
    assert strategy.capacity_of(device) == 0  # not even the plain model fits: nothing to expand
    sites = strategy.sites
    for spare in (10_000_000, 40_000_000, 200_000_000):
        device = DeviceInfo("d", index=0, num_samples=10, memory_budget_bytes=plain + spare)
        capacity = strategy.capacity_of(device)
        assert capacity == affordable_capacity(sites, spare, batch=32, momentum=False)
        assert affordable_capacity(
            sites, spare, batch=32, momentum=False, limit=capacity + 1
        ) == capacity or (capacity == len(sites))
    capped = create_strategy("dynamicfl", _strategy_ctx(max_capacity=1))
    rich = DeviceInfo("d", index=0, num_samples=10, memory_budget_bytes=plain + 10**10)
    assert capped.capacity_of(rich) == 1
    assert strategy.capacity_of(rich) == len(sites)


def test_without_budgets_capacities_are_equal_tiers_by_client_index() -> None:
    strategy = create_strategy("dynamicfl", _strategy_ctx())
    tiers = [strategy.capacity_of(DeviceInfo(f"d{i}", index=i, num_samples=1)) for i in range(9)]
    assert tiers == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    pinned = DeviceInfo("p", index=0, num_samples=1, tier=2)
    assert strategy.capacity_of(pinned) == 2


@pytest.mark.parametrize(
    "options, message",
    [
        ({"protocol": "greedy"}, "protocol"),
        ({"capacities": []}, "capacities"),
        ({"capacities": [1, -1]}, "capacities"),
    ],
)
def test_bad_options_are_refused_by_name(options: dict[str, Any], message: str) -> None:
    with pytest.raises(Exception, match=message):
        create_strategy("dynamicfl", _strategy_ctx(**options))


def test_a_boards_self_report_cannot_inflate_the_round_report() -> None:
    """Counts and structures are the board's word: clipped, or dropped when they name what the model lacks."""
    strategy = create_strategy("dynamicfl", _strategy_ctx())
    task = Task(
        round=0, device_id="evil", spec={}, weights={}, procedure="dynamicfl", hparams={"capacity": 1}
    )
    metrics = {
        "dynamicfl_expanded": 1e300,
        "dynamicfl_grown": math.nan,
        "dynamicfl_cut": "many",
        "dynamicfl_collapsed": -5,
        "dynamicfl_structure": json.dumps({"fc.weight": ["kxk"], "stem.conv": ["rocket"]}),
    }
    result = Result(
        round=0, device_id="evil", task_id="t", spec_id="s", weights={}, num_samples=1, metrics=metrics
    )
    report = strategy.round_report(0, [(task, result)])["dynamicfl"]["c1"]
    assert report["expanded"] <= 8 * len(strategy.sites)
    assert report["grown"] == report["cut"] == report["collapsed"] == 0
    assert strategy.run_summary()["dynamicfl"]["classes"]["c1"]["structures"] == {"evil": None}
    honest = dict(metrics, dynamicfl_structure=json.dumps({"stem.conv": ["kxk", "conv1x1"]}))
    strategy.round_report(
        1,
        [
            (
                task,
                Result(
                    round=1,
                    device_id="evil",
                    task_id="t",
                    spec_id="s",
                    weights={},
                    num_samples=1,
                    metrics=honest,
                ),
            )
        ],
    )
    assert strategy.run_summary()["dynamicfl"]["classes"]["c1"]["structures"] == {
        "evil": {"stem.conv": ["conv1x1", "kxk"]}
    }


def test_on_the_embedded_broker_a_board_with_spare_memory_expands_and_its_plain_upload_is_accepted(
    tmp_path: Path,
) -> None:
    from nestling.server.broker import EmbeddedBroker
    from nestling.server.fleet import run_fleet
    from nestling.server.fleet_config import load_fleet_config
    from tests.server.fleet_harness import fleet_toml, metrics, start_agents, stop_all

    with EmbeddedBroker() as broker:
        config = tmp_path / "fleet.toml"
        config.write_text(
            fleet_toml(
                broker.url, "dyn", devices=2, rounds=2, method="dynamicfl", method_options="", quorum=1.0
            )
        )
        agents = start_agents(tmp_path, broker.url, "dyn", 2, budgets=[0.05, 64.0])  # no spare / plenty spare
        try:
            summary = run_fleet(load_fleet_config(config))
        finally:
            stop_all(agents)
    records = metrics(tmp_path / "out")
    assert all(r["accepted"] == 2 for r in records)
    assert not {k: v for k, v in summary["transport"].items() if k.startswith("rejected_")}
    classes = summary["method_report"]["dynamicfl"]["classes"]
    poor, rich = (
        next(label for label, c in classes.items() if f"dev-{i}" in c["structures"]) for i in (0, 1)
    )
    assert poor == "c0" and classes[poor]["structures"]["dev-0"] == {}
    assert int(rich[1:]) >= 1 and classes[rich]["structures"]["dev-1"]  # expanded convs, uploaded plain


def test_what_each_class_trained_is_described_from_the_run_summary() -> None:
    """A reproduction's table says what was trained (issue 29): the mean expanded convs of each class's final
    structures, read back from summary.json's method_report; a board with no well-formed structure counts 0."""
    strategy = create_strategy("dynamicfl", _strategy_ctx())
    for device, capacity, structure in [
        ("a", 1, {"stem.conv": ["kxk", "conv1x1"]}),
        ("b", 1, None),
        ("c", 2, {"stem.conv": ["kxk"], "blocks.0.conv1": ["kxk", "identity"]}),
    ]:
        task = Task(
            round=0,
            device_id=device,
            spec={},
            weights={},
            procedure="dynamicfl",
            hparams={"capacity": capacity},
        )
        metrics = {} if structure is None else {"dynamicfl_structure": json.dumps(structure)}
        result = Result(
            round=0, device_id=device, task_id="t", spec_id="s", weights={}, num_samples=1, metrics=metrics
        )
        strategy.round_report(0, [(task, result)])
    summary = json.loads(json.dumps(strategy.run_summary()))  # as summary.json holds it
    assert strategy.describe_trained(summary) == (
        "convs expanded in the final round's trained structure: c1 0.50 (2 boards), c2 2.00 (1 board)"
    )
    assert type(strategy).describe_trained({}) == ""
