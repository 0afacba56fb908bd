"""What a board tells the server about itself: a static profile for the hello, a resource snapshot per heartbeat."""

from __future__ import annotations

import os
import platform
from typing import Any

import psutil
import torch

from nestling.edge.board_memory import ProcessMemory, available_bytes, total_bytes


def _temperature_c() -> float | None:
    """Hottest sensor reading (Jetson and Pi throttle when hot); None where the kernel exposes none."""
    reader = getattr(psutil, "sensors_temperatures", None)
    try:
        sensors = reader() if reader else {}
    except (OSError, RuntimeError):
        return None
    readings = [entry.current for entries in sensors.values() for entry in entries if entry.current]
    return max(readings) if readings else None


class ResourceMonitor:
    """Reads the board through psutil / torch; cheap enough to call on every heartbeat."""

    def __init__(self, torch_device: str = "cpu") -> None:
        self.torch_device = torch_device
        self.memory = ProcessMemory()  # emulator-free RSS and peak (edge/board_memory.py)
        psutil.cpu_percent(None)  # prime: the first call has no interval to measure over

    def profile(self) -> dict[str, Any]:
        """Fixed facts about the board (sent once per hello)."""
        facts: dict[str, Any] = {
            "machine": platform.machine(),
            "system": platform.system(),
            "python": platform.python_version(),
            "torch_version": torch.__version__,
            "cores": os.cpu_count() or 1,
            "torch_threads": torch.get_num_threads(),
            "total_memory_bytes": total_bytes(),
            "torch_device": self.torch_device,
        }
        if torch.device(self.torch_device).type == "cuda" and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.device(self.torch_device))
            facts.update(gpu=props.name, gpu_memory_bytes=int(props.total_memory))
        return facts

    def snapshot(self) -> dict[str, Any]:
        """How loaded the board is right now."""
        own = self.memory.reading()
        snap: dict[str, Any] = {
            "cpu_percent": psutil.cpu_percent(None),
            "available_memory_bytes": available_bytes(),
            "rss_bytes": own.rss_bytes,
            "peak_rss_bytes": own.peak_rss_bytes,
        }
        temperature = _temperature_c()
        if temperature is not None:
            snap["temperature_c"] = temperature
        return snap
