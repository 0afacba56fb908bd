"""Broker helpers: the embedded amqtt broker carries multi-MB QoS 1 payloads; mosquitto is launched."""

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nestling.server.broker import (
    EmbeddedBroker,
    find_free_port,
    mosquitto_binary,
    start_mosquitto,
    wait_for_port,
)
from nestling.wire.chunking import (
    ChunkAssembler,
    ChunkCache,
    decode_chunk_request,
    encode_chunk_request,
    frames_to_send,
)
from nestling.wire.client import connect_and_wait, make_client
from nestling.wire.codec import decode_message, encode_message, read_header
from nestling.wire.topics import QOS, FleetTopics

REPO = Path(__file__).resolve().parents[2]


def connected(port: int, client_id: str, *subscriptions: str) -> tuple:
    """A client on 127.0.0.1:port whose messages on `subscriptions` land in the returned queue."""
    inbox: queue.Queue = queue.Queue()
    client = make_client(client_id)
    client.on_message = lambda _c, _u, message: inbox.put(message)
    connect_and_wait(client, "127.0.0.1", port)
    for topic in subscriptions:
        client.subscribe(topic, qos=QOS)
    time.sleep(0.2)  # let SUBACKs land before anything is published
    return client, inbox


def close(*clients) -> None:
    for client in clients:
        client.disconnect()
        client.loop_stop()


def test_embedded_broker_carries_a_5_mb_qos1_payload():
    payload = os.urandom(5 * 1024 * 1024)
    with EmbeddedBroker() as broker:
        assert broker.port > 0 and broker.url == f"mqtt://127.0.0.1:{broker.port}"
        receiver, inbox = connected(broker.port, "receiver", "big/#")
        sender, _ = connected(broker.port, "sender")
        try:
            start = time.perf_counter()
            info = sender.publish("big/blob", payload, qos=QOS)
            message = inbox.get(timeout=30)
            info.wait_for_publish(timeout=30)
            print(f"5 MB QoS 1 through amqtt: {time.perf_counter() - start:.3f} s")
            assert info.is_published() and message.qos == QOS and message.payload == payload
        finally:
            close(receiver, sender)


def test_the_embedded_broker_keeps_its_session_state_machine_quiet_at_info(caplog: pytest.LogCaptureFixture):
    """At --log-level INFO an operator sees the fleet, not amqtt's per-session state changes (the `transitions`
    package logs each one at INFO, from the broker's thread) nor its listener's connection accounting."""
    with caplog.at_level(logging.INFO), EmbeddedBroker() as broker:
        client, _ = connected(broker.port, "chatty")
        close(client)
        time.sleep(0.3)  # the broker handles the disconnect on its own thread
    assert not [r for r in caplog.records if r.name.startswith(("transitions", "amqtt.broker"))]
    assert logging.getLogger("amqtt.broker").isEnabledFor(logging.WARNING)  # its warnings still reach the log


def test_stop_releases_the_port_and_is_idempotent():
    broker = EmbeddedBroker().start()
    port = broker.port
    assert wait_for_port("127.0.0.1", port, 2)
    broker.stop()
    broker.stop()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
    with EmbeddedBroker(port=port) as again:  # the same port can be bound again at once
        assert again.port == port


def test_lost_chunk_is_re_requested_over_the_ctrl_topic():
    """A device's chunked result loses one chunk; the server asks for it on the device's ctrl topic."""
    topics = FleetTopics("chunks")
    weights = {"w": torch.randn(300_000)}  # 1.2 MB: five 256 KiB chunks
    payload = encode_message("result", {"round": 1, "device_id": "d1"}, weights)
    transfer_id, frames = frames_to_send(payload)
    assert transfer_id is not None and len(frames) == 5
    with EmbeddedBroker() as broker:
        server, server_inbox = connected(broker.port, "server", topics.all_devices("result"))
        device, device_inbox = connected(broker.port, "d1", topics.ctrl("d1"))
        try:
            cache = ChunkCache()
            cache.put(transfer_id, frames)
            for index, frame in enumerate(frames):
                if index != 2:  # lost on a flaky link
                    device.publish(topics.result("d1"), frame, qos=QOS)
            assembler = ChunkAssembler()
            for _ in range(4):
                assert assembler.add(server_inbox.get(timeout=10).payload) is None
            server.publish(
                topics.ctrl("d1"), encode_chunk_request(transfer_id, assembler.missing(transfer_id))
            )
            request = decode_chunk_request(device_inbox.get(timeout=10).payload)
            for frame in cache.answer(request):
                device.publish(topics.result("d1"), frame, qos=QOS)
            resent = server_inbox.get(timeout=10).payload
            assert read_header(resent)["index"] == 2
            message = decode_message(assembler.add(resent))
            assert torch.equal(message.tensors["w"], weights["w"])
        finally:
            close(server, device)


def test_broker_cli_serves_until_interrupted():
    port = find_free_port()
    command = (
        f"import sys; from server.broker import broker_main; sys.exit(broker_main(['--port', '{port}']))"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", command],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_for_port("127.0.0.1", port, 20)
        client, inbox = connected(port, "cli-check", "cli/#")
        client.publish("cli/x", b"hi", qos=QOS)
        assert inbox.get(timeout=5).payload == b"hi"
        close(client)
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=20)
    finally:
        process.kill()
    assert process.returncode == 0
    assert f"mqtt://127.0.0.1:{port}" in output and "broker stopped" in output


@pytest.mark.mosquitto
@pytest.mark.skipif(
    mosquitto_binary() is None, reason="mosquitto is not installed (apt-get install mosquitto)"
)
def test_start_mosquitto_plain_loopback():
    port = find_free_port()
    process = start_mosquitto(None, port)
    try:
        client, inbox = connected(port, "plain", "plain/#")
        payload = os.urandom(1024 * 1024)
        client.publish("plain/x", payload, qos=QOS)
        assert inbox.get(timeout=10).payload == payload
        close(client)
    finally:
        process.terminate()
        process.wait(10)


def test_the_embedded_brokers_subscription_table_can_change_while_a_connecting_client_walks_it():
    """amqtt 0.12 walks its subscription table with an await inside the loop when a client connects; another
    client subscribing meanwhile raised 'dictionary changed size during iteration' and the connecting client was
    dropped ('not currently connected' on its next publish). The embedded broker's table iterates a snapshot."""
    with EmbeddedBroker() as broker:
        table = broker._broker._subscriptions  # the real amqtt broker's table
        subscriber, _ = connected(broker.port, "subscriber")
        try:
            subscriber.subscribe("fleet/x/status", qos=1)
            time.sleep(0.3)
            walked = []
            for topic in table:  # what amqtt's connect handler does, with a change in the middle
                walked.append(topic)
                table["fleet/y/status"] = []
            assert "fleet/x/status" in walked and "fleet/y/status" in table
            del table["fleet/y/status"]
            client, _ = connected(broker.port, "after")  # the broker still accepts and serves clients
            close(client)
        finally:
            close(subscriber)
