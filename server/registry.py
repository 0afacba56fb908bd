"""Client registry: devices known from hello messages, their liveness, and stable indices across restarts."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nestling.errors import WireError
from nestling.profiler.board_profile import BoardProfile, ProfileError, parse_board_profile
from nestling.server.enrolment import Enrolment
from nestling.server.strategies.base import DeviceInfo
from nestling.strict_json import strict_dumps
from nestling.wire.schemas import hello_profile

log = logging.getLogger("nestling.registry")


@dataclass
class DeviceRecord:
    """One registered device: what strategies see, and what the transport knows of its liveness."""

    info: DeviceInfo
    online: bool
    last_seen: float
    state: str = "online"


def _board(profile: dict[str, Any]) -> BoardProfile | None:
    """The hello's measured profile summary, checked field by field (rejected as `bad_profile`)."""
    if profile.get("board_profile") is None:
        return None
    try:
        return parse_board_profile(profile["board_profile"])
    except ProfileError as exc:
        raise WireError(f"hello {exc}", reason="bad_profile") from None


def emulated_class(profile: dict[str, Any] | None) -> str | None:
    """The board class a device's hello says it emulates (`nestling agent --emulate`), else None."""
    emulating = (profile or {}).get("emulating")
    if not isinstance(emulating, dict):
        return None
    name, trace_device = str(emulating.get("class", "?"))[:64], emulating.get("trace_device")
    return f"{name} (trace device {str(trace_device)[:64]})" if trace_device else name


JOURNAL_SUFFIX = ".journal"  # registry.json.journal: one JSON line per change since the last snapshot


def _entry(info: DeviceInfo) -> dict[str, Any]:
    """What the registry keeps of a device: what sizing reads, so `nestling plan --fleet RUN_DIR` plans these
    boards as the server does."""
    return {
        "index": info.index,
        "num_samples": info.num_samples,
        "memory_budget_bytes": info.memory_budget_bytes,
        "tier": info.tier,
        "labels": None if info.labels is None else list(info.labels),
        "board_profile": None if info.board is None else info.board.to_dict(),
        "emulating": emulated_class(info.profile),
    }


def read_registry(path: Path) -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
    """(indices, device entries) of a registry: its snapshot with its journal replayed; ValueError if unreadable."""
    indices: dict[str, int] = {}
    devices: dict[str, dict[str, Any]] = {}
    if path.is_file():
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict):
            raise ValueError(f"{path} is not a JSON object")
        indices = {str(k): int(v) for k, v in stored.get("indices", {}).items()}
        devices = {str(k): v for k, v in stored.get("devices", {}).items() if isinstance(v, dict)}
    journal = path.with_name(path.name + JOURNAL_SUFFIX)
    if journal.is_file():
        for number, line in enumerate(journal.read_text().splitlines(), 1):
            try:
                change = json.loads(line)
                device_id, index, entry = str(change["device"]), int(change["index"]), change["entry"]
            except (
                ValueError,
                KeyError,
                TypeError,
            ):  # a line cut short by a crash: the changes before it hold
                log.warning("ignoring unreadable line %d of %s", number, journal)
                continue
            indices[device_id] = index
            if isinstance(entry, dict):
                devices[device_id] = entry
    return indices, devices


class DeviceRegistry:
    """Devices by id. Who may register, at which index and tier, is the enrolment's word (server/enrolment.py),
    never the hello's; an open enrolment's indices are kept in `path` so a resumed server gives every device the
    same index.

    A hello costs one appended journal line (O(1), whatever the fleet's size); the snapshot is rewritten only
    when the journal has grown past the number of devices (amortised O(1)), and on `compact()`."""

    def __init__(
        self,
        path: Path | None = None,
        *,
        heartbeat_timeout_s: float = 30.0,
        enrolment: Enrolment | None = None,
    ) -> None:
        self.path = path
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.enrolment = enrolment if enrolment is not None else Enrolment.open_to(None)
        self.records: dict[str, DeviceRecord] = {}
        self.indices: dict[str, int] = {}
        # every device's entry, also those not back since a restart
        self._stored: dict[str, dict[str, Any]] = {}
        self._journaled = 0
        if path is not None:
            try:
                indices, self._stored = read_registry(path)
            except (OSError, ValueError, AttributeError, TypeError) as exc:
                log.warning("ignoring unreadable registry %s: %s", path, exc)
            else:
                # A closed enrolment is the only source of indices; an open one keeps the seats of earlier runs.
                self.indices = indices if self.enrolment.open else {}
            if self.journal is not None and self.journal.exists():  # fold the last run's changes in
                self.compact()

    @property
    def journal(self) -> Path | None:
        return None if self.path is None else self.path.with_name(self.path.name + JOURNAL_SUFFIX)

    def compact(self) -> None:
        """Write the whole registry as one snapshot (atomically) and empty the journal."""
        if self.path is None or self.journal is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp-{os.getpid()}")
        snapshot = {"indices": self.indices, "devices": self._stored}
        tmp.write_text(strict_dumps(snapshot, indent=1, sort_keys=True))
        os.replace(tmp, self.path)
        self.journal.unlink(missing_ok=True)
        self._journaled = 0

    def _record(self, device_id: str, entry: dict[str, Any]) -> None:
        """Persist one device's change: a journal line; a compaction once the journal outgrows the fleet."""
        self._stored[device_id] = entry
        if self.journal is None:
            return
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        with self.journal.open("a") as fh:
            # the entry holds only values the hello schema checked finite: the strict guard alone suffices
            fh.write(
                json.dumps({"device": device_id, "index": entry["index"], "entry": entry}, allow_nan=False)
            )
            fh.write("\n")
        self._journaled += 1
        if self._journaled > max(64, len(self._stored)):
            self.compact()

    def register(self, device_id: str, profile: dict[str, Any], now: float) -> DeviceInfo:
        """Admit (or refresh) a device from its hello; WireError when it is not enrolled or its profile breaks
        the hello schema. The hello's own `index` and `tier` are checked but ignored: a board claiming another's
        index used to move every other board up a tier."""
        self.enrolment.check(device_id)
        profile = hello_profile(
            profile
        )  # decode_hello checked it already; a direct caller gets the same rules
        board = _board(profile)
        labels = profile.get("labels")
        budget = profile.get("memory_budget_bytes")
        enrolled = self.enrolment.admit(
            device_id, self.indices
        )  # after validation: a refused hello takes no seat
        info = DeviceInfo(
            device_id,
            enrolled.index,
            profile["num_samples"],
            profile=profile,
            memory_budget_bytes=budget,
            labels=None if labels is None else tuple(sorted(set(labels))),
            board=board,
            tier=enrolled.tier,
        )
        previous = self.records.get(device_id)
        self.records[device_id] = DeviceRecord(info, online=True, last_seen=now)
        entry = _entry(info)
        if self._stored.get(device_id) != entry:
            self._record(device_id, entry)
        if previous is None:
            emulating = emulated_class(profile)
            log.info(
                "registered %s (index %d%s, %d samples, budget %s bytes%s)",
                device_id,
                info.index,
                "" if info.tier is None else f", enrolled tier {info.tier}",
                info.num_samples,
                budget,
                f", emulating {emulating}" if emulating else "",
            )
        return info

    def emulated(self) -> dict[str, dict[str, Any]]:
        """Devices that said in their hello they emulate a slower board (`nestling agent --emulate`)."""
        return {
            d: dict(r.info.profile["emulating"])
            for d, r in sorted(self.records.items())
            if r.info.profile and isinstance(r.info.profile.get("emulating"), dict)
        }

    def known(self, device_id: str) -> bool:
        return device_id in self.records

    def heartbeat(self, device_id: str, state: str, now: float) -> None:
        record = self.records[device_id]
        record.online, record.state, record.last_seen = True, state, now

    def offline(self, device_id: str) -> bool:
        """Mark a device gone (last will); True if it was online."""
        record = self.records.get(device_id)
        if record is None or not record.online:
            return False
        record.online, record.state = False, "offline"
        return True

    def expire(self, now: float) -> list[str]:
        """Devices whose heartbeats stopped without a last will (half-open link): now offline."""
        stale = [
            d for d, r in self.records.items() if r.online and now - r.last_seen > self.heartbeat_timeout_s
        ]
        for device_id in stale:
            self.offline(device_id)
        return stale

    def available(self) -> list[DeviceInfo]:
        """Online devices, except those still measuring their profile (their hello says `profiling`)."""
        return [
            r.info for r in self.records.values() if r.online and not (r.info.profile or {}).get("profiling")
        ]
