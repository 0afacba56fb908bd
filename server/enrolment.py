"""The fleet's enrolment: which device ids may join, at which index and pinned tier — the server's word, not a hello's.

A board's hello says what it measured; who it is allowed to be is decided here. A closed enrolment lists the
fleet's devices (`nestling broker-config` writes one, `enrolment.toml`, beside the broker's certificates, or
fleet.toml lists them in `[enrolment] devices`): a device's index is its place in that list, its tier is pinned
only by `[enrolment] tiers`, and any other id is refused as `not_enrolled` before its hello is decoded. An open
enrolment (`[enrolment] open = true` or `nestling server --open-enrolment`) admits the first `[fleet] devices`
distinct ids in order of arrival, each keeping its index across restarts; a stranger can then take a seat but
never more seats than the fleet has, so rounds cannot fill up with ghosts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nestling.errors import ConfigError, WireError
from nestling.wire.broker_settings import read_toml
from nestling.wire.topics import validate_id

MAX_TIER = 1000  # strategies clamp a tier to their largest submodel; this only keeps the number sane
ENROLMENT_KEYS = ("file", "devices", "tiers", "open")


@dataclass(frozen=True)
class Enrolled:
    """One admitted device: its stable index (tiers by index, seeds) and its pinned tier if any."""

    device_id: str
    index: int
    tier: int | None = None


@dataclass
class Enrolment:
    """Who may join: a closed list (`devices`), or open to the first `capacity` ids (None: unbounded)."""

    devices: dict[str, Enrolled] = field(default_factory=dict)
    open: bool = False
    capacity: int | None = None
    source: str = "fleet.toml"

    @classmethod
    def closed(
        cls, device_ids: list[str], tiers: dict[str, int] | None = None, source: str = ""
    ) -> Enrolment:
        """The listed devices only, indexed by their position in the list."""
        tiers = tiers or {}
        stray = sorted(set(tiers) - set(device_ids))
        if stray:
            raise ConfigError(f"[enrolment] tiers names devices that are not enrolled: {', '.join(stray)}")
        devices = {d: Enrolled(d, i, tiers.get(d)) for i, d in enumerate(device_ids)}
        return cls(devices, open=False, source=source or "fleet.toml")

    @classmethod
    def open_to(cls, capacity: int | None) -> Enrolment:
        """Any id the broker lets in, up to `capacity` distinct ids."""
        return cls(open=True, capacity=capacity, source="open")

    def admits(self, device_id: str) -> bool:
        """Whether a message from `device_id` is worth reading at all (open: the seat check comes at admission)."""
        return self.open or device_id in self.devices

    def check(self, device_id: str) -> None:
        """Refuse (WireError `not_enrolled`) an id a closed enrolment does not list, before anything is read."""
        if not self.admits(device_id):
            raise WireError(f"device {device_id!r} is not enrolled in this fleet", reason="not_enrolled")

    def admit(self, device_id: str, indices: dict[str, int]) -> Enrolled:
        """The device's enrolment, assigning an open seat in `indices` (id -> index, kept by the registry).

        WireError(reason="not_enrolled") for an id outside a closed enrolment or beyond an open one's seats."""
        if not self.open:
            self.check(device_id)
            enrolled = self.devices[device_id]
            indices[device_id] = enrolled.index
            return enrolled
        if device_id not in indices:
            if self.capacity is not None and len(indices) >= self.capacity:
                raise WireError(
                    f"device {device_id!r} refused: the open enrolment's {self.capacity} seats are taken",
                    reason="not_enrolled",
                )
            taken = set(indices.values())
            indices[device_id] = next(i for i in range(len(taken) + 1) if i not in taken)
        return Enrolled(device_id, indices[device_id])

    def describe(self) -> str:
        """The line the server prints at start, so an open fleet never goes unnoticed."""
        if self.open:
            seats = "any number of" if self.capacity is None else f"the first {self.capacity}"
            return (
                f"enrolment OPEN: {seats} device ids the broker lets in may join, in order of arrival "
                "(list the fleet's devices in [enrolment] to refuse strangers)"
            )
        pinned = sum(e.tier is not None for e in self.devices.values())
        return (
            f"enrolment: {len(self.devices)} devices from {self.source}"
            f"{f', {pinned} with a pinned tier' if pinned else ''}; any other id is refused"
        )

    def to_dict(self) -> dict[str, Any]:
        """What summary.json records of the enrolment."""
        if self.open:
            return {"open": True, "capacity": self.capacity}
        tiers = {d: e.tier for d, e in self.devices.items() if e.tier is not None}
        return {"open": False, "source": self.source, "devices": list(self.devices), "tiers": tiers}


def _device_list(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where} devices must be a non-empty list of device ids, got {value!r:.60}")
    ids = [validate_id(d, f"{where} device") if isinstance(d, str) else _not_an_id(d, where) for d in value]
    duplicates = sorted({d for d in ids if ids.count(d) > 1})
    if duplicates:
        raise ConfigError(f"{where} devices lists {', '.join(duplicates)} more than once")
    return ids


def _not_an_id(value: object, where: str) -> str:
    raise ConfigError(f"{where} device ids must be strings, got {value!r:.60}")


def _tiers(value: object, where: str) -> dict[str, int]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} tiers must be a table of device id = tier, got {value!r:.60}")
    for device_id, tier in value.items():
        if isinstance(tier, bool) or not isinstance(tier, int) or not 0 <= tier <= MAX_TIER:
            raise ConfigError(
                f"{where} tier of {device_id!r} must be an integer in [0, {MAX_TIER}], got {tier!r:.40}"
            )
    return dict(value)


def read_enrolment_file(path: Path, fleet: str) -> tuple[list[str], dict[str, int]]:
    """(device ids, pinned tiers) of an enrolment.toml, refusing one written for another fleet."""
    data = read_toml(path, "[enrolment] file")
    where = f"enrolment file {path}:"
    unknown = sorted(set(data) - {"fleet", "devices", "tiers"})
    if unknown:
        raise ConfigError(f"{where} unknown keys {unknown} (known: fleet, devices, tiers)")
    if data.get("fleet", fleet) != fleet:
        raise ConfigError(f"{where} is for fleet {data['fleet']!r}, this server runs fleet {fleet!r}")
    return _device_list(data.get("devices"), where), _tiers(data.get("tiers"), where)


def enrolment_from_table(
    table: object, base: Path, *, fleet: str, seats: int | None, open_enrolment: bool = False
) -> Enrolment | None:
    """fleet.toml's `[enrolment]`: a file, a list of devices, or `open = true`; None when it says nothing.

    `open_enrolment` (`nestling server --open-enrolment`) opens it whatever the table says; `seats` bounds an
    open enrolment ([fleet] devices)."""
    if not isinstance(table, dict):
        raise ConfigError(f"[enrolment] must be a table, got {table!r:.60}")
    unknown = sorted(set(table) - set(ENROLMENT_KEYS))
    if unknown:
        raise ConfigError(f"[enrolment] unknown keys {unknown} (known: {', '.join(ENROLMENT_KEYS)})")
    is_open = table.get("open", False)
    if not isinstance(is_open, bool):
        raise ConfigError(f"[enrolment] open must be true or false, got {is_open!r:.40}")
    if is_open or open_enrolment:
        if "file" in table or "devices" in table:
            asked = "--open-enrolment was given" if open_enrolment else "[enrolment] open = true"
            raise ConfigError(f"{asked} but [enrolment] also lists devices: choose one (open, or the list)")
        return Enrolment.open_to(seats)
    if "file" in table and "devices" in table:
        raise ConfigError("[enrolment] has both file and devices: list the devices in one place")
    if "file" in table:
        if not isinstance(table["file"], str) or not table["file"]:
            raise ConfigError(f"[enrolment] file must be a path, got {table['file']!r:.60}")
        path = (base / table["file"]).resolve()
        ids, tiers = read_enrolment_file(path, fleet)
        return Enrolment.closed(ids, {**tiers, **_tiers(table.get("tiers"), "[enrolment]")}, str(path))
    if "devices" in table:
        ids = _device_list(table["devices"], "[enrolment]")
        return Enrolment.closed(ids, _tiers(table.get("tiers"), "[enrolment]"), "fleet.toml [enrolment]")
    if "tiers" in table:
        raise ConfigError("[enrolment] tiers needs the enrolled devices (devices or file)")
    return None


def enrolment_toml(fleet: str, device_ids: list[str]) -> str:
    """What `nestling broker-config` writes beside the broker's config: the fleet's devices, in index order."""
    listed = "\n".join(f'  "{d}",' for d in device_ids)
    return (
        f"# Devices enrolled in Nestling fleet {fleet!r}, written by `nestling broker-config`.\n"
        '# Point the server at it: fleet.toml [enrolment] file = "<this file>". The server refuses any other\n'
        "# device id. A device's index (its seeds, its tier where a method tiers by index) is its place\n"
        "# in this list: append new boards at the end.\n"
        f'fleet = "{fleet}"\n'
        f"devices = [\n{listed}\n]\n\n"
        "[tiers]   # optional: pin a device's submodel tier (0 = smallest), e.g. device-000 = 0\n"
    )
