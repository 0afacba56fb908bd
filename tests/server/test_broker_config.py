"""`nestling broker-config`: files, secrets and certificates; then mosquitto enforcing them for real."""

import base64
import hashlib
import queue
import shutil
import stat
import subprocess
import time

import pytest
from cryptography import x509

from nestling.errors import ConfigError
from nestling.wire.client import TlsFiles, connect_and_wait, make_client, read_credentials
from nestling.wire.topics import QOS, FleetTopics
from nestling.server.broker import find_free_port, mosquitto_binary, start_mosquitto
from nestling.server.broker_config import broker_config_main, mosquitto_password_hash, write_broker_config

needs_mosquitto = pytest.mark.skipif(
    mosquitto_binary() is None, reason="mosquitto is not installed (apt-get install mosquitto)"
)


def test_files_are_written_with_secrets_private(tmp_path):
    files = write_broker_config("lab", 3, tmp_path / "fleet", 18883)
    assert sorted(files.credentials) == ["device-000", "device-001", "device-002", "nestling-server"]
    private = [files.password_file, files.server_key, *files.credentials.values()]
    private += list((tmp_path / "fleet" / "tls" / "clients").glob("*.key"))
    for path in private:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    config = files.config.read_text()
    for line in (
        "allow_anonymous false",
        "require_certificate true",
        "listener 18883",
        "set_tcp_nodelay true",
    ):
        assert line in config
    assert "max_packet_size" in config and str(files.acl_file) in config


def test_passwords_verify_in_mosquittos_pbkdf2_format(tmp_path):
    files = write_broker_config("lab", ["jetson-1"], tmp_path)
    entries = dict(line.split(":", 1) for line in files.password_file.read_text().splitlines())
    credentials = read_credentials(files.credentials["jetson-1"])
    _, algorithm, iterations, salt, digest = entries["jetson-1"].split("$")
    assert algorithm == "7" and len(base64.b64decode(salt)) == 12
    expected = hashlib.pbkdf2_hmac(
        "sha512", credentials.password.encode(), base64.b64decode(salt), int(iterations)
    )
    assert base64.b64decode(digest) == expected
    assert credentials.username == credentials.device_id == "jetson-1" and credentials.fleet == "lab"


def test_acl_gives_each_device_only_its_own_topics(tmp_path):
    files = write_broker_config("lab", ["a", "b"], tmp_path)
    sections = {
        block.splitlines()[0]: set(block.splitlines()[1:])
        for block in files.acl_file.read_text().split("\n\n")
        if block.startswith("user ")
    }
    assert sections["user a"] == {
        "topic write nestling/lab/devices/a/hello",
        "topic write nestling/lab/devices/a/status",
        "topic write nestling/lab/devices/a/result",
        "topic read nestling/lab/devices/a/task",
        "topic read nestling/lab/devices/a/ctrl",
        "topic read nestling/lab/server/status",
    }
    assert sections["user nestling-server"] == {"topic readwrite nestling/lab/#"}


def test_certificates_chain_to_the_fleet_ca(tmp_path):
    files = write_broker_config("lab", ["a"], tmp_path, hosts=["hub.lab", "10.0.0.5"])
    authority = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    server.verify_directly_issued_by(authority)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"hub.lab", "localhost"} <= set(names.get_values_for_type(x509.DNSName))
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {"10.0.0.5", "127.0.0.1"}
    client = x509.load_pem_x509_certificate(
        read_credentials(files.credentials["a"]).tls.cert_file.read_bytes()
    )
    client.verify_directly_issued_by(authority)
    assert client.subject.rfc4514_string() == "CN=a"
    assert read_credentials(files.credentials["a"]).url == "mqtts://hub.lab:8883"


def test_bad_requests_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="device id 'a/b'"):
        write_broker_config("lab", ["a/b"], tmp_path / "x")
    with pytest.raises(ConfigError, match="unique"):
        write_broker_config("lab", ["a", "a"], tmp_path / "x")
    with pytest.raises(ConfigError, match="clashes with the server user"):
        write_broker_config("lab", ["nestling-server"], tmp_path / "x")
    write_broker_config("lab", 1, tmp_path / "y")
    with pytest.raises(ConfigError, match="--force"):
        write_broker_config("lab", 1, tmp_path / "y")


def test_cli_prints_paths_but_never_a_secret(tmp_path, capsys):
    assert broker_config_main(["--fleet", "lab", "--devices", "2", "--out", str(tmp_path)]) == 0
    output = capsys.readouterr().out
    assert str(tmp_path / "mosquitto.conf") in output
    for path in (tmp_path / "credentials").glob("*.toml"):
        assert read_credentials(path).password not in output
    assert "$7$" not in output and "PRIVATE KEY" not in output


@pytest.mark.mosquitto
@needs_mosquitto
@pytest.mark.skipif(shutil.which("mosquitto_passwd") is None, reason="mosquitto_passwd is not installed")
def test_hash_matches_mosquitto_passwd(tmp_path):
    password_file = tmp_path / "passwd"
    command = ["mosquitto_passwd", "-b", "-c", "-H", "sha512-pbkdf2", str(password_file), "alice", "s3cret"]
    subprocess.run(command, check=True)
    reference = password_file.read_text().strip().split(":", 1)[1]
    _, _, iterations, salt, _ = reference.split("$")
    assert (
        mosquitto_password_hash("s3cret", iterations=int(iterations), salt=base64.b64decode(salt))
        == reference
    )


@pytest.fixture(scope="module")
def secured_fleet(tmp_path_factory):
    """mosquitto running the generated config for fleet 'sec' with devices a and b."""
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    port = find_free_port()
    files = write_broker_config(
        "sec", ["a", "b"], tmp_path_factory.mktemp("fleet"), port, bind_address="127.0.0.1"
    )
    process = start_mosquitto(files.config, port)
    yield files, port
    process.terminate()
    process.wait(10)


def tls_client(files, user: str, port: int, *, password: str | None = None, subscribe: tuple = ()) -> tuple:
    """A client logged in as `user` over TLS (optionally with a wrong password), with an inbox."""
    credentials = read_credentials(files.credentials[user])
    client = make_client(
        f"{user}-{time.monotonic_ns()}",
        username=user,
        password=password or credentials.password,
        tls=credentials.tls,
    )
    inbox: queue.Queue = queue.Queue()
    client.on_message = lambda _c, _u, message: inbox.put(message)
    connect_and_wait(client, "127.0.0.1", port, timeout_s=5)
    for topic in subscribe:
        client.subscribe(topic, qos=QOS)
    time.sleep(0.3)  # let SUBACKs land before anything is published
    return client, inbox


def close(*clients) -> None:
    for client in clients:
        client.disconnect()
        client.loop_stop()


def received(inbox: queue.Queue, timeout_s: float) -> list[tuple[str, bytes]]:
    """Everything that arrives within `timeout_s` (after the first message, briefly more)."""
    messages = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            message = inbox.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            break
        messages.append((message.topic, message.payload))
    return messages


@pytest.mark.mosquitto
def test_plain_tcp_is_refused(secured_fleet):
    files, port = secured_fleet
    credentials = read_credentials(files.credentials["a"])
    plain = make_client("plain-a", username="a", password=credentials.password)
    with pytest.raises(ConfigError):
        connect_and_wait(plain, "127.0.0.1", port, timeout_s=3)
    plain.loop_stop()


@pytest.mark.mosquitto
def test_tls_without_a_client_certificate_is_refused(secured_fleet):
    files, port = secured_fleet
    credentials = read_credentials(files.credentials["a"])
    anonymous_tls = make_client(
        "no-cert", username="a", password=credentials.password, tls=TlsFiles(files.ca_cert)
    )
    with pytest.raises(ConfigError):
        connect_and_wait(anonymous_tls, "127.0.0.1", port, timeout_s=3)
    anonymous_tls.loop_stop()


@pytest.mark.mosquitto
def test_wrong_password_is_refused_and_right_one_accepted(secured_fleet):
    files, port = secured_fleet
    with pytest.raises(ConfigError, match="refused the connection"):
        tls_client(files, "a", port, password="not-the-password")
    client, _ = tls_client(files, "a", port)
    close(client)


@pytest.mark.mosquitto
def test_device_cannot_publish_on_another_devices_result(secured_fleet):
    files, port = secured_fleet
    topics = FleetTopics("sec")
    server, server_inbox = tls_client(files, "nestling-server", port, subscribe=(topics.everything,))
    device_a, _ = tls_client(files, "a", port)
    try:
        device_a.publish(topics.result("b"), b"forged result", qos=QOS).wait_for_publish(5)
        device_a.publish(topics.result("a"), b"own result", qos=QOS).wait_for_publish(5)
        assert received(server_inbox, 2.0) == [(topics.result("a"), b"own result")]
    finally:
        close(server, device_a)


@pytest.mark.mosquitto
def test_device_cannot_read_another_devices_task(secured_fleet):
    files, port = secured_fleet
    topics = FleetTopics("sec")
    device_a, inbox_a = tls_client(files, "a", port, subscribe=(topics.task("b"), topics.task("a")))
    device_b, inbox_b = tls_client(files, "b", port, subscribe=(topics.task("b"),))
    server, _ = tls_client(files, "nestling-server", port)
    try:
        server.publish(topics.task("b"), b"task for b", qos=QOS).wait_for_publish(5)
        server.publish(topics.task("a"), b"task for a", qos=QOS).wait_for_publish(5)
        assert received(inbox_a, 2.0) == [(topics.task("a"), b"task for a")]
        assert received(inbox_b, 1.0) == [(topics.task("b"), b"task for b")]
    finally:
        close(device_a, device_b, server)
