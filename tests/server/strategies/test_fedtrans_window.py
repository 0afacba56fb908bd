"""FedTrans's DoC window fitted to the run and said at start, and the deployment tie rule (issue 29 item 2)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from nestling.errors import ConfigError
from nestling.methods.fedtrans.cells import identity_provenance
from nestling.server.strategies import DeviceInfo, StrategyContext, create_strategy
from nestling.server.strategies.fedtrans import FedTrans, growth_window


def _strategy(rounds: int, **options: object) -> FedTrans:
    strategy = create_strategy("fedtrans", StrategyContext("tinycnn", 10, 1, 16, 4, rounds, options=options))
    assert isinstance(strategy, FedTrans)
    return strategy


@pytest.mark.parametrize(
    "rounds, expected",
    [(10, (1, 1)), (40, (1, 3)), (100, (3, 7)), (299, (10, 19)), (300, (10, 20)), (1000, (10, 20))],
)
def test_auto_keeps_the_papers_window_in_long_runs_and_fits_short_runs(
    rounds: int, expected: tuple[int, int]
) -> None:
    gamma, delta, source = growth_window("auto", "auto", rounds)
    assert (gamma, delta) == expected
    assert gamma + delta < rounds  # growth is possible in the run
    assert source == ("paper" if expected == (10, 20) else "scaled to the run")


def test_given_values_are_kept_and_bad_ones_refused_by_name() -> None:
    assert growth_window(10, 20, 10) == (10, 20, "given")
    assert growth_window(4, "auto", 10)[:2] == (4, 1)
    for bad in (0, -1, "soon", True, 1.5):
        with pytest.raises(ConfigError, match='gamma must be an integer >= 1 or "auto"'):
            growth_window(bad, 20, 100)


def test_a_window_as_long_as_the_run_is_announced_as_fedavg(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="nestling.server.strategies.fedtrans"):
        _strategy(10, gamma=10, delta=20)
    assert "never grows, so this run is FedAvg of the seed model" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nestling.server.strategies.fedtrans"):
        strategy = _strategy(10)
    assert "scaled to the 10-round run: gamma 1, delta 1" in caplog.text
    assert strategy.run_summary()["fedtrans"]["growth_window"] == {
        "gamma": 1,
        "delta": 1,
        "source": "scaled to the run",
    }
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nestling.server.strategies.fedtrans"):
        _strategy(400)
    assert caplog.text == ""  # the paper's window fits: nothing to say


def test_a_utility_tie_deploys_the_more_trained_model_not_the_newest() -> None:
    strategy = _strategy(40, capacities=[8])
    seed = strategy.members[0]
    seed.losses = [2.0, 1.5, 1.2, 1.0]
    strategy.members.append(dataclasses.replace(seed, losses=[0.9], born=4, parent=0))  # trained one round
    strategy.lineage.add(0, identity_provenance(len(seed.operations)))
    device = DeviceInfo("dev-00000", 0, 100)
    strategy.capacity(device)
    strategy.utilities["dev-00000"] = [0.3, 0.3]  # inherited: the board has not trained since the birth
    assert strategy.deployed_model(device) == 0
    assert strategy.run_summary()["fedtrans"]["deployed"] == {"dev-00000": "m0"}
    strategy.utilities["dev-00000"] = [0.3, 0.31]  # the child earned a higher utility: it is deployed
    assert strategy.deployed_model(device) == 1
    strategy.members[1].losses = [0.9, 0.8, 0.7, 0.6]  # trained as long as its parent: ties go to the older
    strategy.utilities["dev-00000"] = [0.3, 0.3]
    assert strategy.deployed_model(device) == 0
