"""`nestling broker-config`: a locked-down mosquitto setup for one fleet (TLS, passwords, per-device ACL)."""

from __future__ import annotations

import argparse
import base64
import datetime
import grp
import hashlib
import ipaddress
import json
import os
import pwd
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from nestling.errors import ConfigError
from nestling.server.enrolment import enrolment_toml
from nestling.wire.codec import DEFAULT_MAX_MESSAGE_BYTES
from nestling.wire.topics import DEVICE_PUBLISHES, DEVICE_READS, FleetTopics, validate_id

PBKDF2_ITERATIONS = 1000  # passwords are 192 random bits, so the work factor only needs to be nominal
_PACKET_OVERHEAD = 1024 * 1024  # topic, MQTT fixed header and properties on top of the largest message
MAX_DEVICES = 10_000  # one certificate each: a larger fleet is a typo, and would take minutes to issue
_ACCOUNT_NAME = re.compile(
    r"[a-z_][a-z0-9_-]{0,31}"
)  # POSIX-portable user names (also safe in mosquitto.conf)


@dataclass
class BrokerConfigFiles:
    """Where `write_broker_config` put everything (credentials are per user: devices and the server)."""

    out_dir: Path
    config: Path
    password_file: Path
    acl_file: Path
    enrolment: Path
    ca_cert: Path
    server_cert: Path
    server_key: Path
    credentials: dict[str, Path] = field(default_factory=dict)
    service_dropin: Path | None = None
    notes: list[str] = field(default_factory=list)


def mosquitto_password_hash(
    password: str, *, iterations: int = PBKDF2_ITERATIONS, salt: bytes | None = None
) -> str:
    """mosquitto's PBKDF2-SHA512 password entry: `$7$<iterations>$<salt b64>$<hash b64>` (12-byte salt)."""
    salt = secrets.token_bytes(12) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode("utf-8"), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


class _CertificateAuthority:
    """A fleet's own CA (EC P-256) issuing the broker's server certificate and one client cert per user."""

    def __init__(self, common_name: str, days: int) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = _subject(common_name)
        ca_usage = x509.KeyUsage(
            digital_signature=True,
            key_cert_sign=True,
            crl_sign=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            encipher_only=False,
            decipher_only=False,
        )
        self._cert = (
            self._builder(self._name, self._key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(ca_usage, critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert_pem = self._cert.public_bytes(serialization.Encoding.PEM)
        self.key_pem = _key_pem(self._key)

    def _builder(
        self, subject: x509.Name, public_key: ec.EllipticCurvePublicKey, days: int
    ) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.timezone.utc)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))  # tolerate boards whose clocks lag a little
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        )

    def issue(
        self, common_name: str, *, days: int, server_hosts: list[str] | None = None
    ) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM): a server certificate if `server_hosts` is given, else a client one."""
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            self._builder(_subject(common_name), key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
        )
        if server_hosts:
            names = [
                x509.IPAddress(address) if (address := _ip_address(h)) is not None else x509.DNSName(h)
                for h in server_hosts
            ]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server_hosts else ExtendedKeyUsageOID.CLIENT_AUTH
        cert = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False).sign(
            self._key, hashes.SHA256()
        )
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _subject(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _ip_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _write(path: Path, data: str | bytes, *, secret: bool = False) -> Path:
    """Write a file; secrets are created 0600 from the start, never readable by others even briefly."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def _toml_string(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string


def _device_ids(devices: int | list[str], server_user: str) -> list[str]:
    if isinstance(devices, int) and not isinstance(devices, bool):
        if not 1 <= devices <= MAX_DEVICES:
            raise ConfigError(f"--devices must be a count within 1-{MAX_DEVICES}, got {devices}")
        width = max(3, len(str(devices - 1)))
        ids = [f"device-{i:0{width}d}" for i in range(devices)]
    elif isinstance(devices, list):
        ids = [validate_id(d, "device id") for d in devices]
    else:
        raise ConfigError(f"devices must be a count or a list of ids, got {devices!r}")
    duplicates = sorted({d for d in ids if ids.count(d) > 1})
    if duplicates or not ids:
        raise ConfigError(
            f"device ids must be unique and non-empty (duplicates: {', '.join(duplicates) or 'none'})"
        )
    if server_user in ids:
        raise ConfigError(f"device id {server_user!r} clashes with the server user; rename the device")
    return ids


def _acl(topics: FleetTopics, server_user: str, device_ids: list[str]) -> str:
    lines = [
        f"# Topic ACL for Nestling fleet {topics.fleet!r}, written by `nestling broker-config`.",
        "# A device writes only its own hello/status/result; it reads its own task/ctrl and server/status.",
        "",
        f"user {server_user}",
        f"topic readwrite {topics.everything}",
    ]
    for device_id in device_ids:
        lines += ["", f"user {device_id}"]
        lines += [f"topic write {topics.device(device_id, channel)}" for channel in DEVICE_PUBLISHES]
        lines += [f"topic read {topics.device(device_id, channel)}" for channel in DEVICE_READS]
        lines.append(f"topic read {topics.server_status}")
    return "\n".join(lines) + "\n"


def _mosquitto_conf(
    files: BrokerConfigFiles,
    fleet: str,
    port: int,
    bind_address: str | None,
    max_bytes: int,
    broker_user: str,
) -> str:
    return "\n".join(
        [
            f"# mosquitto configuration for Nestling fleet {fleet!r}, written by `nestling broker-config`.",
            "# Every client must present a certificate signed by tls/ca.crt; its common name IS its broker user",
            "# (use_identity_as_username), so the ACL below applies to the certificate's owner whatever",
            "# username a client claims: another board's password with this board's certificate buys nothing.",
            "# That user is also its MQTT client id (use_username_as_clientid): a board connecting with another",
            "# board's (or the server's) client id gets its own instead, so it cannot take over their session.",
            "per_listener_settings false",
            "# Started as root, mosquitto switches to this account before it opens the server key.",
            f"user {broker_user}",
            "allow_anonymous false",
            f"acl_file {files.acl_file}",
            "# Chunked transfers keep packets small; this only bounds an unchunked message.",
            f"max_packet_size {max_bytes + _PACKET_OVERHEAD}",
            "# Without TCP_NODELAY, small QoS 1 packets wait for delayed ACKs (tens of ms per round trip).",
            "set_tcp_nodelay true",
            "# A result of a large model is a few hundred chunks; queue enough for a server that reconnects.",
            "max_queued_messages 5000",
            "persistence true",
            f"persistence_location {files.out_dir / 'data'}/",
            "",
            f"listener {port}{' ' + bind_address if bind_address else ''}",
            "protocol mqtt",
            f"cafile {files.ca_cert}",
            f"certfile {files.server_cert}",
            f"keyfile {files.server_key}",
            "require_certificate true",
            "use_identity_as_username true",
            "use_username_as_clientid true",
            "tls_version tlsv1.2",
            "",
        ]
    )


def _broker_account(user: str) -> tuple[int, int] | None:
    """(uid, gid) of the account mosquitto drops to when started as root, if it exists here."""
    try:
        account = pwd.getpwnam(user)
    except KeyError:
        return None
    return account.pw_uid, account.pw_gid


def _unreachable_ancestors(path: Path) -> list[Path]:
    """Folders above `path` that an unprivileged broker account cannot pass through (no o+x)."""
    return [parent for parent in [path, *path.parents] if not os.stat(parent).st_mode & 0o001]


def _grant_broker_access(files: BrokerConfigFiles, broker_user: str) -> None:
    """Let the account mosquitto drops to read what it must (server key) and write its persistence folder.

    Started as root (by hand or by Debian's mosquitto.service), mosquitto switches to `broker_user` before it
    opens the key and the persistence database; the key stays unreadable to everyone else (0640 root:group).
    Where this process cannot change ownership, the exact commands go into `files.notes`.
    """
    account = _broker_account(broker_user)
    data_dir = files.out_dir / "data"
    if account is None:
        files.notes.append(
            f"no '{broker_user}' account here: run mosquitto as the user that owns {files.out_dir}"
        )
        return
    uid, gid = account
    group = grp.getgrgid(gid).gr_name
    if os.geteuid() == 0:
        os.chown(files.server_key, 0, gid)
        os.chmod(files.server_key, 0o640)
        os.chown(data_dir, uid, gid)
        os.chmod(data_dir, 0o700)
    elif os.geteuid() != uid:
        files.notes.append(
            f"as root: chgrp {group} {files.server_key} && chmod 0640 {files.server_key} && "
            f"chown {broker_user}:{group} {data_dir}"
        )
    blocked = _unreachable_ancestors(files.out_dir)
    if blocked and os.geteuid() != uid:
        files.notes.append(
            f"mosquitto runs as '{broker_user}' and cannot enter {', '.join(map(str, blocked))}: "
            f"chmod o+x {' '.join(map(str, blocked))} (or write the config under /etc/mosquitto)"
        )


def _service_dropin(config: Path) -> str:
    """A drop-in for Debian's mosquitto.service that starts the broker on this fleet's config."""
    return "\n".join(
        [
            "# Copy to /etc/systemd/system/mosquitto.service.d/nestling.conf, then:",
            "#   systemctl daemon-reload && systemctl restart mosquitto",
            "[Service]",
            "ExecStart=",
            f"ExecStart=/usr/sbin/mosquitto -c {config}",
            "",
        ]
    )


def _credentials(
    fleet: str, user: str, role: str, url: str, password: str, ca: Path, cert: Path, key: Path
) -> str:
    fields = {
        "fleet": fleet,
        "role": role,
        "username": user,
        "password": password,
        "url": url,
        "ca_file": str(ca),
        "cert_file": str(cert),
        "key_file": str(key),
    }
    if role == "device":
        fields["device_id"] = user
    body = "\n".join(f"{name} = {_toml_string(value)}" for name, value in fields.items())
    return (
        f"# Broker credentials of {role} {user!r} in fleet {fleet!r}. Secret: keep this file 0600.\n{body}\n"
    )


def write_broker_config(
    fleet: str,
    devices: int | list[str],
    out_dir: Path,
    port: int = 8883,
    *,
    hosts: list[str] | None = None,
    bind_address: str | None = None,
    server_user: str = "nestling-server",
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    cert_days: int = 825,
    overwrite: bool = False,
    broker_user: str = "mosquitto",
) -> BrokerConfigFiles:
    """Write mosquitto.conf, passwd, acl, a CA with server and client certificates, and credentials files.

    `hosts` are extra names/addresses of the broker for its certificate (localhost and 127.0.0.1 are
    always there); the first one goes into the credentials' broker URL. `broker_user` is the account
    mosquitto drops to when started as root (Debian's: `mosquitto`); it gets read access to the server key
    and owns the persistence folder, nothing else.
    """
    topics = FleetTopics(validate_id(fleet, "fleet"))
    validate_id(server_user, "server user")
    if not isinstance(broker_user, str) or not _ACCOUNT_NAME.fullmatch(broker_user):
        raise ConfigError(f"broker user {broker_user!r} is not an account name (a-z 0-9 _ -, up to 32)")
    device_ids = _device_ids(devices, server_user)
    out_dir = Path(out_dir).resolve()
    if any(ch.isspace() for ch in str(out_dir)):
        raise ConfigError(
            f"output directory {str(out_dir)!r} contains whitespace, which mosquitto.conf cannot quote"
        )
    if not 0 < port < 65536:
        raise ConfigError(f"port must be within 1-65535, got {port}")
    if (out_dir / "mosquitto.conf").exists() and not overwrite:
        raise ConfigError(
            f"{out_dir} already holds a broker config; pass --force to replace it (every device's "
            "credentials and certificates change)"
        )
    hosts = list(dict.fromkeys([*(hosts or []), "localhost", "127.0.0.1"]))
    tls_dir = out_dir / "tls"
    files = BrokerConfigFiles(
        out_dir=out_dir,
        config=out_dir / "mosquitto.conf",
        password_file=out_dir / "passwd",
        acl_file=out_dir / "acl",
        enrolment=out_dir / "enrolment.toml",
        ca_cert=tls_dir / "ca.crt",
        server_cert=tls_dir / "server.crt",
        server_key=tls_dir / "server.key",
    )
    # Keys and passwords: never committed by accident, wherever --out points (a folder inside a clone too).
    _write(
        out_dir / ".gitignore", "# Secrets of a Nestling broker (keys, passwords): never commit them.\n*\n"
    )
    authority = _CertificateAuthority(f"Nestling fleet {fleet} CA", days=cert_days * 4)
    _write(files.ca_cert, authority.cert_pem)
    _write(tls_dir / "ca.key", authority.key_pem, secret=True)
    server_cert, server_key = authority.issue(hosts[0], days=cert_days, server_hosts=hosts)
    _write(files.server_cert, server_cert)
    _write(files.server_key, server_key, secret=True)
    first = _ip_address(hosts[0])
    url_host = f"[{hosts[0]}]" if first is not None and first.version == 6 else hosts[0]
    url = f"mqtts://{url_host}:{port}"
    password_lines = []
    for user, role in [(server_user, "server"), *((d, "device") for d in device_ids)]:
        cert_pem, key_pem = authority.issue(user, days=cert_days)
        cert_path = _write(tls_dir / "clients" / f"{user}.crt", cert_pem)
        key_path = _write(tls_dir / "clients" / f"{user}.key", key_pem, secret=True)
        password = secrets.token_urlsafe(24)
        password_lines.append(f"{user}:{mosquitto_password_hash(password)}")
        text = _credentials(fleet, user, role, url, password, files.ca_cert, cert_path, key_path)
        files.credentials[user] = _write(out_dir / "credentials" / f"{user}.toml", text, secret=True)
    _write(files.password_file, "\n".join(password_lines) + "\n", secret=True)
    _write(files.acl_file, _acl(topics, server_user, device_ids))
    _write(files.enrolment, enrolment_toml(fleet, device_ids))
    (out_dir / "data").mkdir(exist_ok=True)
    _write(files.config, _mosquitto_conf(files, fleet, port, bind_address, max_message_bytes, broker_user))
    files.service_dropin = _write(
        out_dir / "systemd" / "mosquitto.service.d" / "nestling.conf", _service_dropin(files.config)
    )
    _grant_broker_access(files, broker_user)
    return files


def _devices_argument(value: str) -> int | list[str]:
    """A device count (1-MAX_DEVICES) or comma-separated ids; a number out of range is never taken for a name."""
    text = value.strip()
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None:
        if not number.is_integer() or not 1 <= number <= MAX_DEVICES:
            raise argparse.ArgumentTypeError(
                f"a device count must be a whole number within 1-{MAX_DEVICES}, got {text!r}"
            )
        return int(number)
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"empty device id in {text!r} (ids are separated by single commas)")
    for name in names:
        if name.startswith("-"):
            raise argparse.ArgumentTypeError(f"device id {name!r} starts with '-' (a count must be >= 1)")
        try:
            validate_id(name, "device id")
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def broker_config_main(argv: list[str]) -> int:
    """`nestling broker-config --fleet NAME --devices N --out DIR`; prints paths, never a secret."""
    parser = argparse.ArgumentParser(
        prog="nestling broker-config",
        description="Write a locked-down mosquitto setup (TLS, passwords, per-device ACL) for one fleet.",
    )
    parser.add_argument("--fleet", required=True, help="fleet name (topic root nestling/<fleet>/)")
    parser.add_argument(
        "--devices",
        required=True,
        type=_devices_argument,
        help="number of devices (named device-000...) or a comma-separated list of ids",
    )
    parser.add_argument("--out", required=True, type=Path, help="directory to write into")
    parser.add_argument("--port", type=int, default=8883, help="TLS listener port (default 8883)")
    parser.add_argument(
        "--host",
        action="append",
        default=[],
        dest="hosts",
        help="broker hostname or address clients use (repeatable; first goes into the URL)",
    )
    parser.add_argument("--bind", default=None, help="address the listener binds to (default: all)")
    parser.add_argument("--server-user", default="nestling-server", help="username of the coordinator")
    parser.add_argument("--force", action="store_true", help="replace an existing config in --out")
    parser.add_argument(
        "--broker-user",
        default="mosquitto",
        help="account mosquitto drops to when started as root (default: mosquitto)",
    )
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"argument --port: must be within 1-65535, got {args.port}")
    files = write_broker_config(
        args.fleet,
        args.devices,
        args.out,
        args.port,
        hosts=args.hosts,
        bind_address=args.bind,
        server_user=args.server_user,
        overwrite=args.force,
        broker_user=args.broker_user,
    )
    print(f"mosquitto config for fleet {args.fleet!r} in {files.out_dir}:")
    print(f"  config       {files.config}")
    print(f"  passwords    {files.password_file} (0600; the TLS listener authenticates by certificate)")
    print(f"  acl          {files.acl_file}")
    print(f"  enrolment    {files.enrolment} (fleet.toml: [enrolment] file = this path)")
    print(
        f"  tls          {files.ca_cert.parent} (CA, server and {len(files.credentials)} client certificates)"
    )
    print(f"  credentials  {len(files.credentials)} files in {files.out_dir / 'credentials'} (0600)")
    print(f"  service      {files.service_dropin} (drop-in for Debian's mosquitto.service)")
    for note in files.notes:
        print(f"note: {note}")
    account = "stays root" if args.broker_user == "root" else f"drops to '{args.broker_user}'"
    print(f"run: mosquitto -c {files.config}   (started as root it {account}: `user` in the config)")
    print(
        f"  {files.out_dir / '.gitignore'} keeps these secrets out of git; copy each board only its own files"
    )
    return 0
