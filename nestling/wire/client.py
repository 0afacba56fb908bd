"""The one factory for paho MQTT clients: protocol, TLS, credentials, last will and TCP_NODELAY."""

from __future__ import annotations

import socket
import ssl
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt

from nestling.errors import ConfigError
from nestling.wire.topics import QOS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 boards
    import tomli as tomllib

DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS connection: the fleet CA, and this client's certificate and key."""

    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    tls: bool


def parse_broker_url(url: str) -> BrokerAddress:
    """Read `mqtt://host[:port]` or `mqtts://host[:port]` (TLS); ConfigError names what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in DEFAULT_PORTS:
        raise ConfigError(f"broker url {url!r} must start with mqtt:// or mqtts://")
    try:
        port = parts.port or DEFAULT_PORTS[parts.scheme]
    except ValueError as error:
        raise ConfigError(f"broker url {url!r} has an invalid port") from error
    if not parts.hostname:
        raise ConfigError(f"broker url {url!r} names no host")
    return BrokerAddress(host=parts.hostname, port=port, tls=parts.scheme == "mqtts")


@dataclass(frozen=True)
class BrokerCredentials:
    """One user's broker access as `nestling broker-config` writes it to credentials/<user>.toml."""

    fleet: str
    role: str  # "device" or "server"
    url: str
    username: str
    password: str
    tls: TlsFiles
    device_id: str | None = None


def read_credentials(path: Path) -> BrokerCredentials:
    """Load a credentials file; relative TLS paths are taken from the file's own folder."""
    path = Path(path)
    try:
        fields = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"cannot read credentials {str(path)!r}: {error}") from error
    required = ("fleet", "role", "url", "username", "password", "ca_file", "cert_file", "key_file")
    missing = [name for name in required if not isinstance(fields.get(name), str)]
    if missing:
        raise ConfigError(f"credentials {str(path)!r} lack string field(s): {', '.join(missing)}")
    parse_broker_url(fields["url"])
    files = [path.parent / fields[name] for name in ("ca_file", "cert_file", "key_file")]
    return BrokerCredentials(
        fleet=fields["fleet"],
        role=fields["role"],
        url=fields["url"],
        username=fields["username"],
        password=fields["password"],
        tls=TlsFiles(*files),
        device_id=fields.get("device_id"),
    )


def _disable_nagle(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    # Nagle's algorithm holding back small MQTT packets until the peer's delayed ACK made QoS 1
    # round trips take 44-88 ms on loopback; with TCP_NODELAY they take ~0.2 ms.
    raw = getattr(sock, "_socket", sock)  # paho wraps websocket transports
    if getattr(raw, "family", None) in (socket.AF_INET, socket.AF_INET6):
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _require_file(path: Path | None, what: str) -> str | None:
    if path is None:
        return None
    if not Path(path).is_file():
        raise ConfigError(f"TLS {what} {str(path)!r} does not exist")
    return str(path)


def make_client(
    client_id: str,
    *,
    username: str | None = None,
    password: str | None = None,
    tls: TlsFiles | None = None,
    will: tuple[str, bytes, bool] | None = None,
    clean_session: bool = True,
) -> mqtt.Client:
    """A paho client (callback API v2, MQTT 3.1.1) with TCP_NODELAY on every socket it opens.

    `will` is (topic, payload, retain), published at QoS 1 by the broker if the client vanishes.
    The client owns `on_socket_open` (that is where TCP_NODELAY is set); do not replace it.
    """
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        clean_session=clean_session,
        protocol=mqtt.MQTTv311,
    )
    client.on_socket_open = _disable_nagle
    if username is not None:
        client.username_pw_set(username, password)
    if tls is not None:
        if (tls.cert_file is None) != (tls.key_file is None):
            raise ConfigError("TLS needs both a client certificate and its key, or neither")
        client.tls_set(
            ca_certs=_require_file(tls.ca_file, "CA file"),
            certfile=_require_file(tls.cert_file, "certificate file"),
            keyfile=_require_file(tls.key_file, "key file"),
            cert_reqs=ssl.CERT_REQUIRED,
            tls_version=ssl.PROTOCOL_TLS_CLIENT,
        )
    if will is not None:
        topic, payload, retain = will
        client.will_set(topic, payload, qos=QOS, retain=retain)
    client.reconnect_delay_set(min_delay=1, max_delay=30)
    return client


def connect_and_wait(client: mqtt.Client, host: str, port: int, *, timeout_s: float = 10.0) -> None:
    """Connect, start the network thread and return once the broker accepted us (ConfigError if not)."""
    answered = threading.Event()
    outcome: list[str] = []
    # paho types each callback slot as a union of API versions; these are the VERSION2 ones set by make_client.
    previous_connect: Callable[..., None] | None = client.on_connect
    previous_disconnect: Callable[..., None] | None = client.on_disconnect

    def on_connect(cl: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        outcome.append(f"refused the connection: {reason}" if reason.is_failure else "")
        answered.set()
        if previous_connect is not None:
            previous_connect(cl, userdata, flags, reason, properties)

    def on_disconnect(cl: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        # A broker that requires TLS or a client certificate just drops the connection.
        outcome.append("closed the connection before accepting it (TLS or certificate required?)")
        answered.set()
        if previous_disconnect is not None:
            previous_disconnect(cl, userdata, flags, reason, properties)

    client.on_connect, client.on_disconnect = on_connect, on_disconnect
    try:
        try:
            client.connect(host, port, keepalive=30)
        except (OSError, ssl.SSLError) as error:
            raise ConfigError(f"cannot reach MQTT broker {host}:{port}: {error}") from error
        client.loop_start()
        if not answered.wait(timeout_s):
            outcome.append(f"did not accept the connection within {timeout_s}s")
        if outcome[0]:
            client.disconnect()
            client.loop_stop()
            raise ConfigError(f"MQTT broker {host}:{port} {outcome[0]}")
    finally:
        client.on_connect, client.on_disconnect = previous_connect, previous_disconnect
