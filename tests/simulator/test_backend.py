"""The process pool's workers do not outlive the run that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A parent that starts a spawn pool whose worker installs the watchdog, hands it a job far longer than the test,
# prints the worker's pid and waits; the test kills the parent with SIGKILL (no cleanup of any kind runs).
PARENT = """
import multiprocessing as mp, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from nestling.simulator.backend import exit_with_parent

def init():
    exit_with_parent(poll_seconds=0.2)

def busy(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return os.getpid()

def pid():
    return os.getpid()

if __name__ == "__main__":
    pool = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"), initializer=init)
    print(pool.submit(pid).result(), flush=True)
    pool.submit(busy, 600)
    time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie waiting for init to reap it has stopped computing
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_a_busy_pool_worker_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ}
    )
    try:
        worker = int(parent.stdout.readline())  # type: ignore[union-attr]
        time.sleep(0.5)  # the long job is running now
        assert alive(worker)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 20
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker), "the pool worker kept computing after its parent was killed"
    finally:
        parent.kill()
