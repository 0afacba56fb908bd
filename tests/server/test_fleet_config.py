"""fleet.toml: fleet defaults differ from a simulation's, and every mistake is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from nestling.errors import ConfigError
from nestling.server.fleet_config import fleet_config_from_dict, load_fleet_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fleet.toml"


def test_the_example_config_loads():
    config = load_fleet_config(EXAMPLE)
    assert config.broker.fleet == "lab" and config.fleet.devices == 4 and config.min_devices == 4
    assert config.run.method.name == "nefl-wd" and config.run.method.options == {"flex": 0}
    assert config.out_dir == (EXAMPLE.parent / "../runs/fleet").resolve()


def test_fleet_defaults_over_select_and_close_rounds_by_deadline(tmp_path):
    config = fleet_config_from_dict({"fleet": {"devices": 3}}, tmp_path)
    run = config.run.run
    assert (run.over_selection, run.quorum, run.deadline_s) == (1.3, 0.6, 300.0)
    assert config.run.data.clients == 3 and config.min_devices == 3
    assert "password" not in str(config.to_dict())


@pytest.mark.parametrize(
    "table, message",
    [
        ({"data": {"partition": "iid"}}, "belong in each agent.toml"),
        ({"run": {"workers": 2}}, "simulation setting"),
        ({"run": {"deadline_s": 0}}, "deadline_s must be > 0"),
        ({"fleet": {"devices": 0}}, "devices"),
        ({"fleet": {"devices": "four"}}, r"\[fleet\] devices must be int"),
        ({"broker": {"url": "http://x"}}, "mqtt://"),
        ({"broker": {"fleet": "a/b"}}, "fleet"),
        ({"swarm": {}}, "unknown fleet config sections"),
        ({"train": {"lr": -1}}, "lr must be > 0"),
    ],
)
def test_mistakes_are_named(tmp_path, table, message):
    with pytest.raises(ConfigError, match=message):
        fleet_config_from_dict(table, tmp_path)
