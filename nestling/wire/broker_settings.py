"""What fleet.toml and agent.toml share: the [broker] table (where the broker is, how to log in) and typed tables."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

import paho.mqtt.client as mqtt

from nestling.errors import ConfigError
from nestling.wire.client import TlsFiles, make_client, parse_broker_url, read_credentials
from nestling.wire.topics import validate_id

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 boards
    import tomli as tomllib

T = TypeVar("T")


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """A TOML file as a dict; ConfigError names the file when it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {path} is not valid TOML: {exc}") from None


def read_table(cls: type[T], name: str, table: Any) -> T:
    """Build dataclass `cls` from TOML table [name], checking keys and value types against its annotations."""
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}] must be a table")
    hints = get_type_hints(cls)
    unknown = sorted(set(table) - set(hints))
    if unknown:
        raise ConfigError(f"[{name}] unknown keys {unknown} (known: {', '.join(sorted(hints))})")
    values = {}
    for key, value in table.items():
        hint = hints[key]
        options = get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        allowed = tuple(get_origin(t) or t for t in options if t is not type(None))  # list[str] -> list
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
            kinds = " or ".join(t.__name__ for t in allowed)
            raise ConfigError(f"[{name}] {key} must be {kinds}, got {value!r}")
        values[key] = value
    return cls(**values)


@dataclass(frozen=True)
class BrokerSettings:
    """A broker URL and fleet, with either a `nestling broker-config` credentials file or explicit fields."""

    url: str = "mqtt://127.0.0.1:1883"
    fleet: str = "nestling"
    credentials: str | None = None  # credentials/<user>.toml: url, username, password and TLS files
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @classmethod
    def from_table(cls, table: dict[str, Any], base: Path) -> BrokerSettings:
        """Read a [broker] table; relative paths are taken from the config file's folder (`base`)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ConfigError(f"[broker] unknown keys {unknown} (known: {', '.join(sorted(known))})")
        bad = [k for k, v in table.items() if not isinstance(v, str)]
        if bad:
            raise ConfigError(f"[broker] {', '.join(bad)} must be strings")
        values = {
            k: (str(base / v) if k in ("credentials", "ca_file", "cert_file", "key_file") else v)
            for k, v in table.items()
            if v != ""
        }
        settings = cls(**values)
        if settings.credentials is not None:
            creds = read_credentials(Path(settings.credentials))
            settings = cls(
                url=table.get("url") or creds.url,
                fleet=table.get("fleet") or creds.fleet,
                credentials=settings.credentials,
                username=creds.username,
                password=creds.password,
                ca_file=str(creds.tls.ca_file),
                cert_file=str(creds.tls.cert_file),
                key_file=str(creds.tls.key_file),
            )
        settings.check()
        return settings

    def check(self) -> None:
        address = parse_broker_url(self.url)
        validate_id(self.fleet, "[broker] fleet")
        if address.tls and self.ca_file is None:
            raise ConfigError(f"[broker] {self.url} is TLS (mqtts://): set ca_file or a credentials file")
        if (self.username is None) != (self.password is None):
            raise ConfigError("[broker] username and password go together")

    @property
    def host_port(self) -> tuple[str, int]:
        address = parse_broker_url(self.url)
        return address.host, address.port

    def tls(self) -> TlsFiles | None:
        if not parse_broker_url(self.url).tls:
            return None
        assert self.ca_file is not None
        return TlsFiles(
            Path(self.ca_file),
            Path(self.cert_file) if self.cert_file else None,
            Path(self.key_file) if self.key_file else None,
        )

    def client(
        self, client_id: str, *, will: tuple[str, bytes, bool] | None = None, clean_session: bool = False
    ) -> mqtt.Client:
        """A paho client for this broker (TCP_NODELAY, TLS, credentials, last will); not yet connected.

        Sessions are persistent by default: QoS 1 messages sent while a peer is briefly away wait for it."""
        return make_client(
            client_id,
            username=self.username,
            password=self.password,
            tls=self.tls(),
            will=will,
            clean_session=clean_session,
        )
