"""The one MQTT topic scheme of a Nestling fleet: every topic string is built and parsed here."""

from __future__ import annotations

import re
from dataclasses import dataclass

from nestling.errors import ConfigError, WireError

ROOT = "nestling"
# Fleet and device ids end up inside topics, ACL lines and file names, so they exclude MQTT
# wildcards (+ #), separators (/) and anything a shell or TOML file would need quoted.
ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")

QOS = 1  # every topic carries state; handlers are idempotent because QoS 1 is at-least-once

HELLO, STATUS, TASK, RESULT, CTRL = "hello", "status", "task", "result", "ctrl"
DEVICE_CHANNELS = (HELLO, STATUS, TASK, RESULT, CTRL)
DEVICE_PUBLISHES = (HELLO, STATUS, RESULT)  # what a device may write (the broker ACL enforces it)
DEVICE_READS = (TASK, CTRL)  # what a device may read besides server/status
RETAINED_CHANNELS = (STATUS,)  # plus server/status: late subscribers learn the current state at once

OFFLINE = b"offline"  # last-will payload on devices/<id>/status


def is_legal_id(value: object) -> bool:
    """True when `value` may be used as a fleet or device id."""
    return isinstance(value, str) and ID_PATTERN.fullmatch(value) is not None and value not in (".", "..")


def validate_id(value: str, what: str = "id") -> str:
    """Return `value` if it is a legal fleet/device id, else raise ConfigError saying why."""
    if not is_legal_id(value):
        raise ConfigError(f"{what} {value!r} is not allowed (use 1-64 of A-Z a-z 0-9 _ . -, not '.' or '..')")
    return value


@dataclass(frozen=True)
class FleetTopics:
    """Topic builder for one fleet, so no caller ever concatenates topic strings."""

    fleet: str

    def __post_init__(self) -> None:
        validate_id(self.fleet, "fleet")

    @property
    def root(self) -> str:
        return f"{ROOT}/{self.fleet}"

    @property
    def everything(self) -> str:
        """Wildcard for the server's subscription and ACL: the whole fleet."""
        return f"{self.root}/#"

    @property
    def server_status(self) -> str:
        return f"{self.root}/server/status"

    def device(self, device_id: str, channel: str) -> str:
        validate_id(device_id, "device id")
        if channel not in DEVICE_CHANNELS:
            raise ConfigError(f"unknown device channel {channel!r} (known: {', '.join(DEVICE_CHANNELS)})")
        return f"{self.root}/devices/{device_id}/{channel}"

    def all_devices(self, channel: str) -> str:
        """Wildcard matching `channel` of every device, e.g. the server's result subscription."""
        if channel not in DEVICE_CHANNELS:
            raise ConfigError(f"unknown device channel {channel!r} (known: {', '.join(DEVICE_CHANNELS)})")
        return f"{self.root}/devices/+/{channel}"

    def hello(self, device_id: str) -> str:
        return self.device(device_id, HELLO)

    def status(self, device_id: str) -> str:
        return self.device(device_id, STATUS)

    def task(self, device_id: str) -> str:
        return self.device(device_id, TASK)

    def result(self, device_id: str) -> str:
        return self.device(device_id, RESULT)

    def ctrl(self, device_id: str) -> str:
        return self.device(device_id, CTRL)


@dataclass(frozen=True)
class ParsedTopic:
    """A topic taken apart: `device_id` is None for server topics; `channel` is the last level."""

    fleet: str
    channel: str
    device_id: str | None = None

    @property
    def is_server_status(self) -> bool:
        return self.device_id is None and self.channel == STATUS


def parse_topic(topic: str) -> ParsedTopic:
    """Take an incoming topic apart; WireError for anything outside the scheme (never trust it)."""
    levels = topic.split("/") if isinstance(topic, str) else []
    if len(levels) < 4 or levels[0] != ROOT or not is_legal_id(levels[1]):
        raise WireError(f"topic {topic!r} is not under {ROOT}/<fleet>/")
    fleet = levels[1]
    if len(levels) == 4 and levels[2] == "server" and levels[3] == STATUS:
        return ParsedTopic(fleet=fleet, channel=STATUS)
    if len(levels) == 5 and levels[2] == "devices" and levels[4] in DEVICE_CHANNELS:
        device_id = levels[3]
        if not is_legal_id(device_id):
            raise WireError(f"topic {topic!r} names an illegal device id {device_id!r}")
        return ParsedTopic(fleet=fleet, channel=levels[4], device_id=device_id)
    raise WireError(
        f"topic {topic!r} is not one of the fleet's topics (devices/<id>/<channel>, server/status)"
    )
