"""The fleet topic scheme: built and parsed in one place, ids validated before they reach a topic."""

import pytest

from nestling.errors import ConfigError, WireError
from nestling.wire.topics import FleetTopics, ParsedTopic, parse_topic, validate_id


def test_device_and_server_topics_live_under_the_fleet_root():
    topics = FleetTopics("lab-1")
    assert topics.task("jetson.07") == "nestling/lab-1/devices/jetson.07/task"
    assert topics.result("rpi_3") == "nestling/lab-1/devices/rpi_3/result"
    assert topics.status("rpi_3") == "nestling/lab-1/devices/rpi_3/status"
    assert topics.hello("rpi_3") == "nestling/lab-1/devices/rpi_3/hello"
    assert topics.ctrl("rpi_3") == "nestling/lab-1/devices/rpi_3/ctrl"
    assert topics.server_status == "nestling/lab-1/server/status"
    assert topics.all_devices("result") == "nestling/lab-1/devices/+/result"
    assert topics.everything == "nestling/lab-1/#"


def test_parse_topic_inverts_the_builders():
    topics = FleetTopics("lab")
    for channel in ("hello", "status", "task", "result", "ctrl"):
        assert parse_topic(topics.device("d-1", channel)) == ParsedTopic("lab", channel, "d-1")
    server = parse_topic(topics.server_status)
    assert server.is_server_status and server.device_id is None and server.fleet == "lab"


@pytest.mark.parametrize("bad", ["", "a/b", "dev+", "dev#", "with space", "x" * 65, ".", "..", "é"])
def test_illegal_ids_are_refused_with_the_reason(bad):
    with pytest.raises(ConfigError, match="not allowed"):
        validate_id(bad, "device id")
    with pytest.raises(ConfigError):
        FleetTopics("lab").task(bad)


def test_unknown_channel_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown device channel 'results'"):
        FleetTopics("lab").device("d1", "results")


@pytest.mark.parametrize(
    "topic",
    [
        "other/lab/devices/d1/task",
        "nestling/lab/devices/d1/tasks",
        "nestling/lab/devices/d1/task/extra",
        "nestling/lab/devices/../task",
        "nestling/lab/server/hello",
        "nestling/la+b/devices/d1/task",
        "nestling",
    ],
)
def test_foreign_topics_are_wire_errors(topic):
    with pytest.raises(WireError):
        parse_topic(topic)
