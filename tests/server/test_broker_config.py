"""`nestling broker-config`: files, secrets and certificates; then mosquitto enforcing them for real."""

import base64
import hashlib
import os
import queue
import shutil
import stat
import subprocess
import time

import pytest
from cryptography import x509

from nestling.errors import ConfigError
from nestling.server.broker import find_free_port, mosquitto_binary, start_mosquitto
from nestling.server.broker_config import (
    MAX_DEVICES,
    _broker_account,
    broker_config_main,
    mosquitto_password_hash,
    write_broker_config,
)
from nestling.server.enrolment import read_enrolment_file
from nestling.wire.client import TlsFiles, connect_and_wait, make_client, read_credentials
from nestling.wire.topics import QOS, FleetTopics
from tests.server.broker_folders import broker_folder

needs_mosquitto = pytest.mark.skipif(
    mosquitto_binary() is None, reason="mosquitto is not installed (apt-get install mosquitto)"
)


def test_files_are_written_with_secrets_private(tmp_path):
    files = write_broker_config("lab", 3, tmp_path / "fleet", 18883)
    assert sorted(files.credentials) == ["device-000", "device-001", "device-002", "nestling-server"]
    private = [files.password_file, *files.credentials.values(), files.ca_cert.parent / "ca.key"]
    private += list((tmp_path / "fleet" / "tls" / "clients").glob("*.key"))
    for path in private:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    # The broker's own key: readable by the account mosquitto drops to (when there is one), by nobody else.
    assert stat.S_IMODE(files.server_key.stat().st_mode) in (0o600, 0o640)
    assert not files.server_key.stat().st_mode & 0o007
    config = files.config.read_text()
    for line in (
        "allow_anonymous false",
        "require_certificate true",
        "use_identity_as_username true",
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


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ("-2", "count must be a whole number within 1-"),
        ("0", "count must be a whole number"),
        ("2.5", "count must be a whole number"),
        ("nan", "count must be a whole number"),
        (str(MAX_DEVICES + 1), f"within 1-{MAX_DEVICES}"),
        ("a,,b", "empty device id"),
        ("a,-b", "starts with '-'"),
        ("a,b/c", "device id 'b/c' is not allowed"),
    ],
)
def test_invalid_device_counts_and_names_are_refused_by_name(tmp_path, capsys, devices, message):
    """`--devices -2` used to make credentials for a device named '-2'."""
    with pytest.raises(SystemExit) as exit_:
        broker_config_main(["--fleet", "lab", "--devices", devices, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "argument --devices" in error and message in error
    assert not (tmp_path / "out").exists()


def test_invalid_port_and_broker_account_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        broker_config_main(["--fleet", "lab", "--devices", "1", "--out", str(tmp_path), "--port", "0"])
    assert "--port: must be within 1-65535" in capsys.readouterr().err
    for account in ("mosquitto\nlistener 1883", "Root", "", "a b"):  # it becomes a line of mosquitto.conf
        with pytest.raises(ConfigError, match="is not an account name"):
            write_broker_config("lab", 1, tmp_path / "x", broker_user=account)


def test_secrets_are_ignored_by_git_wherever_they_are_written(tmp_path):
    """`--out fleet-broker/` inside a clone used to leave the CA key and every password untracked, not ignored."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    files = write_broker_config("lab", 2, tmp_path / "fleet-broker")
    (tmp_path / "README").write_text("tracked")
    status = subprocess.run(
        ["git", "-C", str(tmp_path), "status", "--porcelain", "--untracked-files=all"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert status.splitlines() == ["?? README"], status
    assert (files.out_dir / ".gitignore").read_text().splitlines()[-1] == "*"


def test_the_enrolment_lists_the_devices_in_index_order(tmp_path):
    files = write_broker_config("lab", ["jetson-1", "rpi-7", "rpi-2"], tmp_path)
    assert read_enrolment_file(files.enrolment, "lab") == (["jetson-1", "rpi-7", "rpi-2"], {})
    with pytest.raises(ConfigError, match="is for fleet 'lab'"):
        read_enrolment_file(files.enrolment, "other")


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
    files = write_broker_config("sec", ["a", "b"], broker_folder(), port, bind_address="127.0.0.1")
    process = start_mosquitto(files.config, port)
    yield files, port
    process.terminate()
    process.wait(10)


def tls_client(
    files,
    user: str,
    port: int,
    *,
    password: str | None = None,
    subscribe: tuple = (),
    username: str | None = None,
    client_id: str | None = None,
) -> tuple:
    """A client with `user`'s certificate over TLS (optionally claiming another username/password or client
    id), with an inbox."""
    credentials = read_credentials(files.credentials[user])
    client = make_client(
        client_id or f"{user}-{time.monotonic_ns()}",
        username=username or user,
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


def wait_for_listener(port: int, timeout_s: float) -> bool:
    """True once a socket listens on `port` (read from /proc/net/tcp, so nothing connects to find out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open("/proc/net/tcp") as table:
            for row in table.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                if state == "0A" and int(local.split(":")[1], 16) == port:  # 0A = LISTEN
                    return True
        time.sleep(0.05)
    return False


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


def test_root_hands_the_broker_account_its_key_and_data_but_nothing_else(tmp_path):
    account = _broker_account("mosquitto")
    if os.geteuid() != 0 or account is None:
        pytest.skip("needs root and Debian's mosquitto account")
    files = write_broker_config("lab", 2, tmp_path / "fleet", 18883)
    uid, gid = account
    key = files.server_key.stat()
    assert (key.st_uid, key.st_gid, stat.S_IMODE(key.st_mode)) == (0, gid, 0o640)
    data = (files.out_dir / "data").stat()
    assert (data.st_uid, stat.S_IMODE(data.st_mode)) == (uid, 0o700)
    for secret in [files.password_file, files.ca_cert.parent / "ca.key", *files.credentials.values()]:
        assert secret.stat().st_gid != gid or not secret.stat().st_mode & 0o040, secret
    # pytest's folders are 0700 root: the broker account could not enter them, and the CLI says so.
    assert any("cannot enter" in note for note in files.notes)
    assert "ExecStart=/usr/sbin/mosquitto -c " + str(files.config) in files.service_dropin.read_text()


@pytest.mark.mosquitto
def test_the_documented_command_runs_as_root_without_extra_config():
    """`mosquitto -c mosquitto.conf` as written: as root it drops to its own account and still serves."""
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    port = find_free_port()
    files = write_broker_config("doc", ["a"], broker_folder(), port, bind_address="127.0.0.1")
    assert "\nuser mosquitto\n" in files.config.read_text()  # Debian's account, said explicitly
    assert files.notes == [] or os.geteuid() != 0
    process = subprocess.Popen(
        [mosquitto_binary(), "-c", str(files.config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        # Not wait_for_port: its bare TCP probe never says hello, and mosquitto logs an OpenSSL error for it.
        assert wait_for_listener(port, 10), process.stdout.read1().decode() if process.poll() else ""
        client, _ = tls_client(files, "a", port)
        close(client)
        assert process.poll() is None
    finally:
        process.terminate()
        output = process.communicate(timeout=10)[0].decode(errors="replace")
    assert "Error" not in output, output


@pytest.mark.mosquitto
def test_another_devices_password_with_my_certificate_does_not_make_me_that_device(secured_fleet):
    """The certificate is the identity: claiming b's username and password with a's certificate is still a."""
    files, port = secured_fleet
    topics = FleetTopics("sec")
    server, server_inbox = tls_client(files, "nestling-server", port, subscribe=(topics.everything,))
    password_b = read_credentials(files.credentials["b"]).password
    impostor, _ = tls_client(files, "a", port, username="b", password=password_b)
    try:
        impostor.publish(topics.result("b"), b"forged as b", qos=QOS).wait_for_publish(5)
        impostor.publish(topics.result("a"), b"a's own result", qos=QOS).wait_for_publish(5)
        assert received(server_inbox, 2.0) == [(topics.result("a"), b"a's own result")]
    finally:
        close(server, impostor)


@pytest.mark.mosquitto
def test_each_device_connects_with_its_own_certificate(secured_fleet):
    files, port = secured_fleet
    topics = FleetTopics("sec")
    server, server_inbox = tls_client(files, "nestling-server", port, subscribe=(topics.everything,))
    device_a, _ = tls_client(files, "a", port)
    device_b, _ = tls_client(files, "b", port)
    try:
        device_a.publish(topics.result("a"), b"from a", qos=QOS).wait_for_publish(5)
        device_b.publish(topics.result("b"), b"from b", qos=QOS).wait_for_publish(5)
        assert sorted(received(server_inbox, 2.0)) == [
            (topics.result("a"), b"from a"),
            (topics.result("b"), b"from b"),
        ]
    finally:
        close(server, device_a, device_b)


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


def watch_disconnects(client) -> list:
    """Records every disconnect the broker inflicts on `client` (paho reconnects by itself afterwards)."""
    drops: list = []
    client.on_disconnect = lambda _c, _u, _flags, reason, _props: drops.append(reason)
    return drops


def takeover(files, port: int, victim: str, victim_id: str, attacker: str) -> tuple[list, bool, list]:
    """`attacker` connects with its own certificate but `victim`'s client id while the victim is online:
    (the victim's disconnects, whether it is still connected, what a third party hears from it afterwards)."""
    topics = FleetTopics("sec")
    listener_user = "a" if victim == "nestling-server" else "nestling-server"
    listener, inbox = tls_client(files, listener_user, port, subscribe=(topics.everything,))
    target, _ = tls_client(files, victim, port, client_id=victim_id)
    drops = watch_disconnects(target)
    impostor, _ = tls_client(files, attacker, port, client_id=victim_id)
    try:
        time.sleep(0.5)  # a takeover drops the victim at once; give the broker time to do it
        connected = target.is_connected()
        topic = topics.server_status if victim == "nestling-server" else topics.result(victim)
        if connected:
            target.publish(topic, b"still here", qos=QOS).wait_for_publish(5)
        heard = [payload for t, payload in received(inbox, 1.0) if t == topic]
        return list(drops), connected, heard  # a copy: closing the clients below adds our own disconnect
    finally:
        close(listener, target, impostor)


@pytest.mark.mosquitto
def test_another_boards_client_id_cannot_knock_it_off_the_broker(secured_fleet):
    """The broker replaces every client id by the certificate's user, so a's client takes over nothing of b's."""
    files, port = secured_fleet
    drops, connected, heard = takeover(files, port, "b", "nestling-sec-b", attacker="a")
    assert drops == [] and connected and heard == [b"still here"]


@pytest.mark.mosquitto
def test_a_board_cannot_knock_the_server_off_the_broker(secured_fleet):
    files, port = secured_fleet
    for claimed in ("nestling-sec-server", "nestling-server"):  # what the server sends, and what it becomes
        drops, connected, heard = takeover(files, port, "nestling-server", claimed, attacker="b")
        assert drops == [] and connected and heard == [b"still here"], claimed


@pytest.mark.mosquitto
def test_without_the_binding_the_same_client_id_takes_a_board_over():
    """The control: the attack is real on a listener that trusts the client id a client sends."""
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    port = find_free_port()
    files = write_broker_config("sec", ["a", "b"], broker_folder(), port, bind_address="127.0.0.1")
    text = files.config.read_text()
    assert "use_username_as_clientid true" in text
    files.config.write_text(text.replace("use_username_as_clientid true", ""))
    process = start_mosquitto(files.config, port)
    try:
        drops, _, _ = takeover(files, port, "b", "nestling-sec-b", attacker="a")
        assert drops, "the broker kept both clients: the control did not reproduce the takeover"
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.mosquitto
def test_broker_user_root_keeps_root_and_reads_its_key(capsys):
    """`--broker-user root` used to print that mosquitto drops to root but write no `user` line: mosquitto then
    dropped to its own account and could not read the root-only server key (Permission denied)."""
    if mosquitto_binary() is None or os.geteuid() != 0:
        pytest.skip("needs root and mosquitto")
    port = find_free_port()
    out = broker_folder() / "fleet"
    argv = [
        "--fleet",
        "sec",
        "--devices",
        "a",
        "--out",
        str(out),
        "--port",
        str(port),
        "--broker-user",
        "root",
    ]
    argv += ["--bind", "127.0.0.1"]
    assert broker_config_main(argv) == 0
    assert "started as root it stays root" in capsys.readouterr().out
    config = out / "mosquitto.conf"
    assert "\nuser root\n" in config.read_text()
    assert stat.S_IMODE((out / "tls" / "server.key").stat().st_mode) == 0o640
    process = start_mosquitto(config, port)
    try:
        client = make_client("root-check", tls=read_credentials(out / "credentials" / "a.toml").tls)
        connect_and_wait(client, "127.0.0.1", port, timeout_s=5)
        client.disconnect()
        client.loop_stop()
        assert process.poll() is None
    finally:
        process.terminate()
        process.wait(10)
