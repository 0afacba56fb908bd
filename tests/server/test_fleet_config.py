"""fleet.toml: fleet defaults differ from a simulation's, and every mistake is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from nestling.errors import ConfigError
from nestling.server.fleet_config import fleet_config_from_dict, load_fleet_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fleet.toml"
OPEN = {"enrolment": {"open": True}}


def test_the_example_config_loads():
    config = load_fleet_config(EXAMPLE)
    assert config.broker.fleet == "lab" and config.fleet.devices == 4 and config.min_devices == 4
    assert config.run.method.name == "nefl-wd" and config.run.method.options == {"flex": 0}
    assert config.out_dir == (EXAMPLE.parent / "../runs/fleet").resolve()
    assert not config.enrolment.open and list(config.enrolment.devices) == [f"board-{i}" for i in range(4)]


def test_fleet_defaults_over_select_and_close_rounds_by_deadline(tmp_path):
    config = fleet_config_from_dict({"fleet": {"devices": 3}, **OPEN}, tmp_path)
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
        ({"train": {"lr": -1}}, "lr must be a finite number > 0"),
    ],
)
def test_mistakes_are_named(tmp_path, table, message):
    with pytest.raises(ConfigError, match=message):
        fleet_config_from_dict({**OPEN, **table}, tmp_path)


def test_a_fleet_without_an_enrolment_is_refused_until_it_says_open(tmp_path):
    with pytest.raises(ConfigError, match=r"no \[enrolment\].*open = true.*--open-enrolment"):
        fleet_config_from_dict({"fleet": {"devices": 3}}, tmp_path)
    opened = fleet_config_from_dict({"fleet": {"devices": 3}}, tmp_path, open_enrolment=True)
    assert opened.enrolment.open and opened.enrolment.capacity == 3  # open, but never more seats than devices
    assert "enrolment OPEN" in opened.enrolment.describe()
    assert opened.to_dict()["enrolment"] == {"open": True, "capacity": 3}


def test_the_enrolment_sets_the_fleet_size_and_must_agree_with_it(tmp_path):
    listed = {"enrolment": {"devices": ["a", "b", "c"], "tiers": {"c": 0}}}
    config = fleet_config_from_dict(listed, tmp_path)
    assert config.fleet.devices == 3 and config.run.data.clients == 3 and config.min_devices == 3
    assert [(e.index, e.tier) for e in config.enrolment.devices.values()] == [(0, None), (1, None), (2, 0)]
    with pytest.raises(ConfigError, match=r"\[fleet\] devices = 4 but the enrolment .* lists 3"):
        fleet_config_from_dict({**listed, "fleet": {"devices": 4}}, tmp_path)


def test_the_enrolment_file_broker_config_writes_is_read_relative_to_fleet_toml(tmp_path):
    (tmp_path / "broker").mkdir()
    (tmp_path / "broker" / "enrolment.toml").write_text(
        'fleet = "lab"\ndevices = ["x", "y"]\n[tiers]\ny = 1\n'
    )
    table = {"broker": {"fleet": "lab"}, "enrolment": {"file": "broker/enrolment.toml"}}
    config = fleet_config_from_dict(table, tmp_path)
    assert {d: (e.index, e.tier) for d, e in config.enrolment.devices.items()} == {
        "x": (0, None),
        "y": (1, 1),
    }
    with pytest.raises(ConfigError, match="is for fleet 'lab', this server runs fleet 'other'"):
        fleet_config_from_dict({**table, "broker": {"fleet": "other"}}, tmp_path)


@pytest.mark.parametrize(
    "enrolment, message",
    [
        ({"devices": []}, "non-empty list"),
        ({"devices": "a,b"}, "non-empty list"),
        ({"devices": ["a", 3]}, "must be strings"),
        ({"devices": ["a", "a"]}, "lists a more than once"),
        ({"devices": ["a/b"]}, "'a/b' is not allowed"),
        ({"devices": ["a"], "tiers": {"b": 1}}, "not enrolled: b"),
        ({"devices": ["a"], "tiers": {"a": -1}}, r"tier of 'a' must be an integer in \[0, 1000\]"),
        ({"devices": ["a"], "tiers": {"a": "big"}}, "tier of 'a' must be an integer"),
        ({"devices": ["a"], "tiers": {"a": True}}, "tier of 'a' must be an integer"),
        ({"devices": ["a"], "open": True}, "choose one"),
        ({"devices": ["a"], "file": "e.toml"}, "both file and devices"),
        ({"file": "missing.toml"}, "does not exist"),
        ({"open": "yes"}, "open must be true or false"),
        ({"tiers": {"a": 1}}, "needs the enrolled devices"),
        ({"allow": ["a"]}, "unknown keys"),
    ],
)
def test_enrolment_mistakes_are_named(tmp_path, enrolment, message):
    with pytest.raises(ConfigError, match=message):
        fleet_config_from_dict({"enrolment": enrolment}, tmp_path)


def test_allowed_devices_points_to_the_enrolment(tmp_path):
    with pytest.raises(ConfigError, match=r"allowed_devices is now \[enrolment\] devices"):
        fleet_config_from_dict({"fleet": {"allowed_devices": ["a"]}, **OPEN}, tmp_path)
