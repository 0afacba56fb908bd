"""The board's own memory figures: a cgroup's limit caps what it offers for training, and under qemu-user its
resident memory is the guest's, the emulator's own mappings left out (the layout below is what qemu 7.2
showed an arm64 Python in scripts/board_check_arm64.sh's rootfs: maps emulated, smaps passed through)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nestling.edge import board_memory
from nestling.edge.board_memory import (
    ProcessMemory,
    available_bytes,
    cgroup_headroom,
    cgroup_limit,
    emulator_of,
    guest_resident_bytes,
    total_bytes,
)

GUEST_MAPS = """\
00400000-00716000 r-xp 00000000 fe:00 1234 /usr/bin/python3.11
00916000-0092f000 rw-p 00000000 00:00 0
5500baa000-550d611000 rw-p 00000000 00:00 0
"""


def smaps(guest_heap_kb: int) -> str:
    """Host smaps of the emulator process: the guest's three mappings plus qemu's binary, heap and TCG buffer."""
    entries = [
        ("00400000-00716000 r-xp 00000000 fe:00 1234 /usr/bin/python3.11", 3000),
        ("00916000-0092f000 rw-p 00000000 00:00 0", 100),
        ("5500baa000-550d611000 rw-p 00000000 00:00 0", guest_heap_kb),
        ("555568f47000-55556940b000 rw-p 00000000 00:00 0 [heap]", 4728),
        ("7fd328000000-7fd32ffff000 rwxp 00000000 00:00 0", 16384),
        ("7fd336400000-7fd336628000 r--p 00000000 fe:00 99 /usr/bin/qemu-aarch64-static", 2208),
    ]
    return "".join(f"{head}\nSize: 4 kB\nRss: {kb} kB\nPss: {kb} kB\n" for head, kb in entries)


def test_under_qemu_the_guests_pages_are_counted_and_the_emulators_are_not() -> None:
    assert emulator_of(GUEST_MAPS, smaps(1000)) == "/usr/bin/qemu-aarch64-static"
    assert guest_resident_bytes(GUEST_MAPS, smaps(200_000)) == (3000 + 100 + 200_000) * 1024


def test_natively_nothing_is_an_emulator_and_the_figures_are_vmrss_and_vmhwm() -> None:
    own = Path("/proc/self")
    assert emulator_of((own / "maps").read_text(), (own / "smaps").read_text()) is None
    memory = ProcessMemory()
    before = memory.reading()
    assert before.source == "VmRSS/VmHWM"
    assert abs(before.rss_bytes - psutil.Process().memory_info().rss) < 16 * 2**20
    block = bytearray(96 * 2**20)
    block[::4096] = b"\x01" * len(block[::4096])  # touch every page
    during = memory.reading()
    del block
    assert during.rss_bytes >= before.rss_bytes + 90 * 2**20
    assert memory.reading().peak_rss_bytes >= during.rss_bytes


def test_under_emulation_the_peak_is_sampled_between_readings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short spike no reading saw is still in the peak: the sampler thread caught it."""
    (tmp_path / "maps").write_text(GUEST_MAPS)
    (tmp_path / "smaps").write_text(smaps(1000))
    monkeypatch.setattr(board_memory, "PROC_SELF", tmp_path)
    memory = ProcessMemory(sample_s=0.01)
    try:
        assert memory.emulator == "/usr/bin/qemu-aarch64-static"
        (tmp_path / "smaps").write_text(smaps(300_000))  # the spike
        time.sleep(0.2)
        (tmp_path / "smaps").write_text(smaps(2000))
        time.sleep(0.05)
        reading = memory.reading()
    finally:
        memory.close()
    assert reading.rss_bytes == (3000 + 100 + 2000) * 1024
    assert reading.peak_rss_bytes == (3000 + 100 + 300_000) * 1024
    assert "qemu-aarch64-static excluded" in reading.source


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_cgroup_v2_the_tightest_limit_on_the_way_up_counts_with_its_reclaimable_cache(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/nestling-agent.service\n")
    sys_root = tmp_path / "sys"
    gib = 2**30
    _tree(
        sys_root,
        {
            "cgroup.controllers": "memory",
            "system.slice/memory.max": str(3 * gib),
            "system.slice/memory.current": str(gib),
            "system.slice/memory.stat": "anon 1\ninactive_file 0\n",
            "system.slice/nestling-agent.service/memory.max": str(gib),
            "system.slice/nestling-agent.service/memory.current": str(gib // 2),
            "system.slice/nestling-agent.service/memory.stat": f"anon 1\ninactive_file {gib // 8}\n",
        },
    )
    assert cgroup_headroom(proc, sys_root) == gib // 2 + gib // 8
    assert cgroup_limit(proc, sys_root) == gib and total_bytes(proc, sys_root) == min(
        gib, psutil.virtual_memory().total
    )
    (sys_root / "system.slice/nestling-agent.service/memory.max").write_text("max\n")
    assert cgroup_headroom(proc, sys_root) == 2 * gib
    (sys_root / "system.slice/memory.max").write_text("max\n")
    assert cgroup_headroom(proc, sys_root) is None
    assert available_bytes(proc, sys_root) > 0


def test_cgroup_v1_memory_controller_and_a_namespaced_path(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/docker/abc\n3:cpu:/docker/abc\n0::/\n")
    sys_root = tmp_path / "sys"
    mib = 2**20
    _tree(  # a container sees its own group at the mount's root: /docker/abc does not exist there
        sys_root,
        {
            "memory/memory.limit_in_bytes": str(512 * mib),
            "memory/memory.usage_in_bytes": str(300 * mib),
            "memory/memory.stat": f"cache 1\ntotal_inactive_file {20 * mib}\n",
        },
    )
    assert cgroup_headroom(proc, sys_root) == 232 * mib
    (sys_root / "memory/memory.limit_in_bytes").write_text(str(9223372036854771712))  # v1's "no limit"
    assert cgroup_headroom(proc, sys_root) is None
    assert cgroup_headroom(tmp_path / "absent", sys_root) is None


def _memory_cgroup_v1() -> Path | None:
    root = Path("/sys/fs/cgroup/memory")
    return root if os.geteuid() == 0 and (root / "memory.limit_in_bytes").exists() else None


@pytest.mark.skipif(_memory_cgroup_v1() is None, reason="needs root and a cgroup v1 memory controller")
def test_an_agent_in_a_real_memory_cgroup_offers_no_more_than_its_limit(tmp_path: Path) -> None:
    """The figure the board sends for training, in a real 768 MiB cgroup on this host (kernel-enforced)."""
    root = _memory_cgroup_v1()
    assert root is not None
    group = root / f"nestling-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(768 * 2**20))
        probe = (
            "import os, sys; open(sys.argv[1], 'w').write(str(os.getpid()));"
            "from nestling.edge.self_profile import available_memory; print(available_memory('cpu'))"
        )
        # enter the group before Python starts: the shell writes its own pid, then execs the interpreter
        script = f'echo $$ > {group}/cgroup.procs && exec {sys.executable} -c "{probe}" {tmp_path / "pid"}'
        done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        offered = int(done.stdout.strip())
        assert 0 < offered <= 768 * 2**20 < psutil.virtual_memory().available
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
