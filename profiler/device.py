"""The device section of a profile: CPU, memory, GPU, measured sustained GFLOP/s, Jetson power and thermal state."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import torch

_DEVICE_TREE_MODEL = Path("/proc/device-tree/model")
_TEGRA_RELEASE = Path("/etc/nv_tegra_release")
_THERMAL = Path("/sys/class/thermal")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").replace("\x00", "").strip()
    except OSError:
        return None


def board_model() -> str | None:
    """The board name on ARM boards (Jetson, Raspberry Pi) from the device tree."""
    return _read(_DEVICE_TREE_MODEL) or None


def cpu_model() -> str:
    text = _read(Path("/proc/cpuinfo")) or ""
    for key in ("model name", "Hardware", "Model", "cpu model"):
        match = re.search(rf"^{key}\s*:\s*(.+)$", text, re.MULTILINE)
        if match:
            return match.group(1).strip()
    return platform.processor() or platform.machine()


def gpu_info() -> dict[str, Any] | None:
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    return {
        "name": props.name,
        "total_bytes": int(total),
        "free_bytes": int(free),
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
    }


def measure_gflops(device: str = "cpu", seconds: float = 1.0, size: int | None = None) -> dict[str, Any]:
    """Sustained float32 matmul throughput: repeated n×n products for about `seconds` (2n³ FLOPs each)."""
    dev = torch.device(device)
    n = size or (2048 if dev.type == "cuda" else 512)
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    torch.matmul(a, b)  # warm-up: kernels, caches, clocks
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    iterations, started = 0, time.perf_counter()
    while True:
        torch.matmul(a, b)
        iterations += 1
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - started
        if elapsed >= seconds and iterations >= 3:
            break
    return {
        "device": str(dev),
        "size": n,
        "iterations": iterations,
        "seconds": elapsed,
        "threads": torch.get_num_threads(),
        "gflops": 2.0 * n**3 * iterations / elapsed / 1e9,
    }


def thermal_zones() -> dict[str, float]:
    """Temperatures (°C) from sysfs thermal zones: present on Jetson, Raspberry Pi and most laptops."""
    temps: dict[str, float] = {}
    for zone in sorted(_THERMAL.glob("thermal_zone*")):
        kind, value = _read(zone / "type"), _read(zone / "temp")
        if kind and value and value.lstrip("-").isdigit():
            temps[kind] = int(value) / 1000.0
    return temps


_POWER = re.compile(r"\b((?:VDD|POM|VIN)_\w+) (\d+)(?:mW)?/(\d+)(?:mW)?")
_TEMP = re.compile(r"\b(\w+)@(-?\d+(?:\.\d+)?)C\b")
_RAM = re.compile(r"\bRAM (\d+)/(\d+)MB")


def parse_tegrastats(line: str) -> dict[str, Any]:
    """One tegrastats line → RAM, per-rail power (current, average mW) and temperatures (°C)."""
    out: dict[str, Any] = {"power_mw": {}, "temperatures_c": {}}
    ram = _RAM.search(line)
    if ram:
        out["ram_used_mb"], out["ram_total_mb"] = int(ram.group(1)), int(ram.group(2))
    for name, current, average in _POWER.findall(line):
        out["power_mw"][name] = {"current": int(current), "average": int(average)}
    for name, value in _TEMP.findall(line):
        out["temperatures_c"][name] = float(value)
    return out


def is_jetson() -> bool:
    return _TEGRA_RELEASE.exists() or "jetson" in (board_model() or "").lower()


def _from_jtop() -> dict[str, Any] | None:
    try:
        from jtop import jtop  # jetson-stats, optional
    except ImportError:
        return None
    try:
        with jtop() as jetson:
            stats = dict(jetson.stats)
            mode = str(getattr(jetson, "nvpmodel", "")) or None
    except Exception:
        return None
    return {
        "source": "jetson-stats",
        "nvpmodel": mode,
        "temperatures_c": {
            k[5:]: v for k, v in stats.items() if k.startswith("Temp ") and isinstance(v, (int, float))
        },
        "power_mw": {
            k[6:]: {"current": v}
            for k, v in stats.items()
            if k.startswith("Power ") and isinstance(v, (int, float))
        },
    }


def _from_tegrastats(timeout: float = 3.0) -> dict[str, Any] | None:
    binary = shutil.which("tegrastats")
    if binary is None:
        return None
    try:
        proc = subprocess.Popen([binary, "--interval", "200"], stdout=subprocess.PIPE, text=True)
    except OSError:
        return None
    try:
        line = proc.stdout.readline() if proc.stdout else ""
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"source": "tegrastats", "raw": line.strip(), **parse_tegrastats(line)} if line.strip() else None


def jetson_state() -> dict[str, Any] | None:
    """Board power and thermal state on a Jetson (jetson-stats, else tegrastats); None elsewhere."""
    if not is_jetson():
        return None
    return (
        _from_jtop()
        or _from_tegrastats()
        or {"source": None, "temperatures_c": thermal_zones(), "power_mw": {}}
    )


def device_info(device: str = "cpu", gflops_seconds: float = 1.0) -> dict[str, Any]:
    """Everything a planner needs to know about this machine besides per-model measurements."""
    memory = psutil.virtual_memory()
    return {
        "hostname": platform.node(),
        "board": board_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": {
            "model": cpu_model(),
            "physical_cores": psutil.cpu_count(logical=False),
            "logical_cores": psutil.cpu_count(logical=True),
            "torch_threads": torch.get_num_threads(),
        },
        "memory": {"total_bytes": int(memory.total), "available_bytes": int(memory.available)},
        "gpu": gpu_info(),
        "compute": measure_gflops(device, gflops_seconds),
        "thermal_c": thermal_zones(),
        "jetson": jetson_state(),
    }
