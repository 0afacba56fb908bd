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

log = logging.getLogger("nestling.registry")


@dataclass
class DeviceRecord:
    """One registered device: what strategies see, and what the transport knows of its liveness."""

    info: DeviceInfo
    online: bool
    last_seen: float
    state: str = "online"


# Upper bounds of hello fields: generous for any real board, small enough that nothing downstream
# (tier arithmetic, aggregation weights, memory planning) ever meets an absurd or unrepresentable number.
HELLO_MAXIMUMS = {"num_samples": 10**9, "index": 10**6, "memory_budget_bytes": 2**50}


def _optional_int(profile: dict[str, Any], name: str, minimum: int) -> int | None:
    value = profile.get(name)
    if value is None:
        return None
    maximum = HELLO_MAXIMUMS[name]
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise WireError(
            f"hello field {name!r} must be an integer in [{minimum}, {maximum}], got {value!r:.40}"
        )
    return value


def _labels(profile: dict[str, Any]) -> tuple[int, ...] | None:
    labels = profile.get("labels")
    if labels is None:
        return None
    if (
        not isinstance(labels, list)
        or len(labels) > 100_000
        or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 10**6 for v in labels)
    ):
        raise WireError("hello field 'labels' must be a list of class indices")
    return tuple(sorted(set(labels)))


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


class DeviceRegistry:
    """Devices by id. Who may register, at which index and tier, is the enrolment's word (server/enrolment.py),
    never the hello's; an open enrolment's indices are kept in `path` so a resumed server gives every device the
    same index."""

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
        # A closed enrolment is the only source of indices; an open one keeps the seats of earlier runs.
        self.indices: dict[str, int] = self._load() if self.enrolment.open else {}

    def _load(self) -> dict[str, int]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            stored = json.loads(self.path.read_text())
            return {str(k): int(v) for k, v in stored.get("indices", {}).items()}
        except (ValueError, AttributeError, TypeError) as exc:
            log.warning("ignoring unreadable registry %s: %s", self.path, exc)
            return {}

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp-{os.getpid()}")
        devices = {
            d: {
                "index": r.info.index,
                "num_samples": r.info.num_samples,
                "memory_budget_bytes": r.info.memory_budget_bytes,
                # what sizing reads, so `nestling plan --fleet RUN_DIR` plans these boards as the server does
                "tier": r.info.tier,
                "labels": None if r.info.labels is None else list(r.info.labels),
                "board_profile": None if r.info.board is None else r.info.board.to_dict(),
                "emulating": emulated_class(r.info.profile),
            }
            for d, r in self.records.items()
        }
        tmp.write_text(json.dumps({"indices": self.indices, "devices": devices}, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def register(self, device_id: str, profile: dict[str, Any], now: float) -> DeviceInfo:
        """Admit (or refresh) a device from its hello; WireError when it is not enrolled or its profile is
        unusable. The hello's own `index` and `tier` are ignored: a board claiming another's index used to
        move every other board up a tier."""
        self.enrolment.check(device_id)
        num_samples = _optional_int(profile, "num_samples", 0)
        if num_samples is None:
            raise WireError("hello lacks 'num_samples'")
        budget = _optional_int(profile, "memory_budget_bytes", 1)
        _optional_int(profile, "index", 0)  # still checked: a hostile value is refused, not carried along
        labels = _labels(profile)
        board = _board(profile)
        if not isinstance(profile.get("profiling", False), bool):
            raise WireError("hello field 'profiling' must be true or false", reason="bad_profile")
        indices_before = dict(self.indices)
        enrolled = self.enrolment.admit(
            device_id, self.indices
        )  # after validation: a refused hello takes no seat
        info = DeviceInfo(
            device_id,
            enrolled.index,
            num_samples,
            profile=profile,
            memory_budget_bytes=budget,
            labels=labels,
            board=board,
            tier=enrolled.tier,
        )
        previous = self.records.get(device_id)
        self.records[device_id] = DeviceRecord(info, online=True, last_seen=now)
        if previous is None or previous.info.profile != info.profile or self.indices != indices_before:
            self._save()
        if previous is None:
            emulating = emulated_class(profile)
            log.info(
                "registered %s (index %d%s, %d samples, budget %s bytes%s)",
                device_id,
                info.index,
                "" if info.tier is None else f", enrolled tier {info.tier}",
                num_samples,
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
