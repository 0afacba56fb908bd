"""A restarted server never acts on messages queued for it while it was down (issue 25), on a real mosquitto."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nestling.server.broker import find_free_port, mosquitto_binary, start_mosquitto
from nestling.server.clock import WallClock
from nestling.server.mqtt_transport import MqttTransport, TransportSettings, server_client
from nestling.server.registry import DeviceRegistry
from nestling.wire.broker_settings import BrokerSettings
from nestling.wire.client import connect_and_wait, make_client
from nestling.wire.fleet_messages import encode_hello
from nestling.wire.topics import QOS, FleetTopics

pytestmark = [
    pytest.mark.mosquitto,
    pytest.mark.skipif(mosquitto_binary() is None, reason="mosquitto is not installed"),
]
FLEET = "restart"


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    port = find_free_port()
    process = start_mosquitto(None, port)
    yield port
    process.terminate()
    process.wait(10)


def started(port: int, client) -> MqttTransport:
    transport = MqttTransport(
        client, FleetTopics(FLEET), DeviceRegistry(), WallClock(), TransportSettings(rehello_every_s=60.0)
    )
    transport.connect("127.0.0.1", port)
    return transport


def hellos_while_down(port: int) -> None:
    """A poisoned hello (it made servers fail before the schema) and an honest one, sent while no server runs."""
    board = make_client("a-board")
    connect_and_wait(board, "127.0.0.1", port)
    topics = FleetTopics(FLEET)
    for device_id, tier in (("poisoned", "abc"), ("honest", 1)):
        payload = encode_hello(device_id, {"num_samples": 10, "tier": tier})
        board.publish(topics.hello(device_id), payload, qos=QOS).wait_for_publish(5)
    board.disconnect()
    board.loop_stop()


def test_a_restarted_server_never_acts_on_what_was_queued_while_it_was_down(port: int) -> None:
    broker = BrokerSettings(url=f"mqtt://127.0.0.1:{port}", fleet=FLEET)
    topics = FleetTopics(FLEET)
    # Control: a persistent session (what the server used before) gets both hellos on its restart.
    persistent = started(port, broker.client("nestling-restart-server", clean_session=False))
    persistent.close()
    hellos_while_down(port)
    replayed = started(port, broker.client("nestling-restart-server", clean_session=False))
    replayed.wait_for_devices(1, 5.0)
    assert replayed.registry.known("honest") and replayed.counters["rejected_bad_hello"] == 1
    replayed.close()

    first = started(port, server_client(broker, topics))
    first.close()
    hellos_while_down(port)
    restarted = started(port, server_client(broker, topics))
    assert restarted.wait_for_devices(1, 2.0) == []
    assert not restarted.registry.known("honest") and not restarted.registry.known("poisoned")
    assert not any(name.startswith("rejected_") for name in restarted.counters)
    # What boards say once it runs is heard as always.
    board = make_client("a-live-board")
    connect_and_wait(board, "127.0.0.1", port)
    board.publish(topics.hello("live"), encode_hello("live", {"num_samples": 5}), qos=QOS).wait_for_publish(5)
    assert [d.device_id for d in restarted.wait_for_devices(1, 5.0)] == ["live"]
    board.disconnect()
    board.loop_stop()
    restarted.close()
