"""The board's own memory figures, right where the obvious readings are wrong.

Two places they are. Under a memory cgroup (a container, a systemd unit with `MemoryMax=`) the kernel's
MemAvailable — what psutil reports — ignores the limit the agent will be killed at, so the figure it sends the
server for training must be the cgroup's headroom when that is smaller. And under a user-mode emulator
(qemu-user running an arm64 userland on an x86 host, as scripts/board_check_arm64.sh does) the process's
VmRSS, VmHWM, getrusage and psutil's RSS all describe the emulator's host process: the guest's pages plus
qemu's own translation buffers and heap. qemu shows the guest its own mappings in /proc/self/maps but passes
/proc/self/smaps through from the host, so the guest's resident memory is the Rss of the smaps entries that lie
inside the guest's mappings; its peak is sampled (VmHWM cannot be split). Natively both are VmRSS/VmHWM.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import psutil

PROC_SELF = Path("/proc/self")
CGROUP_ROOT = Path("/sys/fs/cgroup")
SAMPLE_S = 0.25  # peak sampling under emulation: a training step there lasts seconds
_RANGE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63


def _ranges(text: str) -> list[tuple[int, int, str]]:
    """(start, end, path) of each mapping line of a maps/smaps text."""
    found = []
    for line in text.splitlines():
        match = _RANGE.match(line)
        if match:
            fields = line.split(None, 5)
            found.append((int(match[1], 16), int(match[2], 16), fields[5].strip() if len(fields) > 5 else ""))
    return found


def emulator_of(maps: str, smaps: str) -> str | None:
    """The user-mode emulator this process runs under (its binary, mapped into the host process but hidden
    from the guest's own maps), or None when it runs natively."""
    guest_paths = {path for _, _, path in _ranges(maps)}
    for _, _, path in _ranges(smaps):
        name = os.path.basename(path)
        if name.startswith("qemu-") and path not in guest_paths:
            return path
    return None


def guest_resident_bytes(maps: str, smaps: str) -> int:
    """Resident bytes of the smaps entries inside the guest's own mappings: the emulator's are left out."""
    guest = sorted((start, end) for start, end, _ in _ranges(maps))
    starts = [start for start, _ in guest]
    total, inside = 0, False
    for line in smaps.splitlines():
        match = _RANGE.match(line)
        if match:
            start, end = int(match[1], 16), int(match[2], 16)
            i = bisect.bisect_right(starts, start) - 1
            inside = (i >= 0 and guest[i][1] > start) or (i + 1 < len(guest) and guest[i + 1][0] < end)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def _status_kb(field: str) -> int | None:
    with contextlib.suppress(OSError):
        for line in (PROC_SELF / "status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return None


@dataclass(frozen=True)
class MemoryReading:
    """This process's resident and peak resident bytes, and what measured them."""

    rss_bytes: int
    peak_rss_bytes: int
    source: str  # "VmRSS/VmHWM" natively, "guest mappings (qemu-... excluded)" under emulation


class ProcessMemory:
    """Resident memory of this process as the board sees it, emulator excluded; samples the peak itself
    when the kernel's high-water mark would count the emulator."""

    def __init__(self, sample_s: float = SAMPLE_S) -> None:
        self.emulator: str | None = None
        with contextlib.suppress(OSError):
            self.emulator = emulator_of(self._read("maps"), self._read("smaps"))
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if self.emulator is not None:
            self.resident()
            thread = threading.Thread(target=self._sample, args=(sample_s,), name="peak-memory", daemon=True)
            thread.start()

    @staticmethod
    def _read(name: str) -> str:
        return (PROC_SELF / name).read_text()

    def resident(self) -> int:
        """Resident bytes now (and a peak sample under emulation)."""
        if self.emulator is None:
            rss = _status_kb("VmRSS") or int(psutil.Process().memory_info().rss)
        else:
            rss = guest_resident_bytes(self._read("maps"), self._read("smaps"))
        with self._lock:
            self._peak = max(self._peak, rss)
        return rss

    def reading(self) -> MemoryReading:
        rss = self.resident()
        with self._lock:
            peak = self._peak
        if self.emulator is None:  # the kernel's high-water mark, which no sampling can miss
            return MemoryReading(rss, max(peak, _status_kb("VmHWM") or 0), "VmRSS/VmHWM")
        return MemoryReading(
            rss, peak, f"guest mappings, sampled every {SAMPLE_S:g} s ({self.emulator} excluded)"
        )

    def _sample(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            with contextlib.suppress(OSError, ValueError):
                self.resident()

    def close(self) -> None:
        self._stop.set()


def _cgroup_dirs(proc_cgroup: Path, root: Path) -> list[Path]:
    """This process's memory cgroup folders, innermost first, up to the hierarchy's root (v2 or v1)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found: list[Path] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: the unified hierarchy, at the root (pure v2) or under unified/ (hybrid)
            bases = [root, root / "unified"]
        elif "memory" in controllers.split(","):
            bases = [root / "memory"]
        else:
            continue
        for base in bases:
            if not base.is_dir():
                continue
            folder = base / path.lstrip("/")
            if not folder.is_dir():  # a cgroup namespace: the process's own group is the mount's root
                folder = base
            while True:
                found.append(folder)
                if folder == base:
                    break
                folder = folder.parent
    return found


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _inactive_file(folder: Path) -> int:
    """Page cache the kernel reclaims before it kills: counted as free within the group."""
    try:
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if " " in line)
    except (OSError, ValueError):
        return 0
    return int(stat.get("total_inactive_file", stat.get("inactive_file", 0)))


def cgroup_headroom(proc_cgroup: Path = PROC_SELF / "cgroup", root: Path = CGROUP_ROOT) -> int | None:
    """Bytes this process's memory cgroups still allow (the tightest of them), or None without a limit."""
    headroom: int | None = None
    for folder in _cgroup_dirs(proc_cgroup, root):
        for limit_name, usage_name in (
            ("memory.max", "memory.current"),
            ("memory.limit_in_bytes", "memory.usage_in_bytes"),
        ):
            limit = _read_int(folder / limit_name)
            usage = _read_int(folder / usage_name)
            if limit is None or usage is None or limit >= _NO_LIMIT:
                continue
            free = max(limit - usage + _inactive_file(folder), 0)
            headroom = free if headroom is None else min(headroom, free)
    return headroom


def cgroup_limit(proc_cgroup: Path = PROC_SELF / "cgroup", root: Path = CGROUP_ROOT) -> int | None:
    """The tightest memory limit of this process's cgroups, or None without one."""
    limits = [
        limit
        for folder in _cgroup_dirs(proc_cgroup, root)
        for name in ("memory.max", "memory.limit_in_bytes")
        if (limit := _read_int(folder / name)) is not None and limit < _NO_LIMIT
    ]
    return min(limits) if limits else None


def total_bytes(proc_cgroup: Path = PROC_SELF / "cgroup", root: Path = CGROUP_ROOT) -> int:
    """The board's memory as this process may use it: RAM, or its cgroup's limit when that is smaller."""
    total = int(psutil.virtual_memory().total)
    limit = cgroup_limit(proc_cgroup, root)
    return total if limit is None else min(total, limit)


def available_bytes(proc_cgroup: Path = PROC_SELF / "cgroup", root: Path = CGROUP_ROOT) -> int:
    """Memory a new allocation can take now: the kernel's MemAvailable, capped by the cgroup's headroom."""
    available = int(psutil.virtual_memory().available)
    headroom = cgroup_headroom(proc_cgroup, root)
    return available if headroom is None else min(available, headroom)
