"""Board classes a simulated fleet is drawn from: published figures, each with its source.

Every figure comes from shared/DEVICES.md (tags V = verified, D = derived, R = vendor
documentation, not re-checked) or from the network sources cited below. Sustained training
speed = FP32 peak x a utilisation factor; the factors are assumptions (DEVICES.md §2), so
ratios between classes are more trustworthy than absolute seconds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import MappingProxyType

from nestling.errors import ConfigError

GIB = 2**30

# DEVICES.md §2: ARM CPUs in PyTorch reach 0.2-0.4 of the FP32 ceiling. We take the low end:
# the Pi HPL runs reach only ~40-50 % of their FP64 peak [2][6], conv training stays under half
# of GEMM, and the measured 2-core x86 host of §2 reaches ~40 GFLOP/s, a low share of its peak.
CPU_UTILISATION = 0.2
# DEVICES.md §2: Jetson GPUs in fp32 eager PyTorch reach 0.1-0.3 of peak (FLEdge [23]: memory
# bound); we take the middle.
JETSON_GPU_UTILISATION = 0.2

# Share of RAM a training job may use. Linux boards: an 8 GB Orin Nano with a desktop OS has
# roughly 5-6 GB free (DEVICES.md §1 notes, R); 0.6 keeps headroom for data loading.
BOARD_BUDGET_FRACTION = 0.6
# Assumption (R): a background training job on a phone gets about a quarter of its RAM.
PHONE_BUDGET_FRACTION = 0.25
# Assumption (R): a laptop keeps half its RAM for its user.
LAPTOP_BUDGET_FRACTION = 0.5


@dataclass(frozen=True)
class NetworkProfile:
    """Typical link of a class of device to a cloud broker, with where the figures come from."""

    name: str
    down_bps: float
    up_bps: float
    latency_s: float
    source: str


FIXED_BROADBAND = NetworkProfile(
    "fixed broadband (Wi-Fi/Ethernet behind a home or office line)",
    down_bps=85.73e6,
    up_bps=45.74e6,
    latency_s=0.021,
    source="Speedtest Global Index, Sep 2020 global fixed broadband: 85.73 Mbit/s down, 45.74 up, "
    "21 ms (quoted at my-financial-wealth.com/2020/10/25/the-global-mobile-and-broadband-internet-"
    "speed-ranking)",
)
MOBILE = NetworkProfile(
    "mobile network",
    down_bps=35.96e6,
    up_bps=11.22e6,
    latency_s=0.040,
    source="Speedtest Global Index, Sep 2020 global mobile: 35.96 Mbit/s down, 11.22 up, 40 ms (same page)",
)


@dataclass(frozen=True)
class BoardClass:
    """One class of device: its memory, sustained training speed, link and power, with sources."""

    name: str
    description: str
    kind: str  # "board", "phone" or "laptop": decides the synthetic availability pattern
    compute_unit: str  # what PyTorch trains on: "cpu" or "gpu"
    ram_bytes: int
    memory_budget_bytes: int
    peak_gflops_fp32: float
    peak_derivation: str
    utilisation: float
    power_w: float
    network: NetworkProfile
    sources: tuple[str, ...]

    @property
    def sustained_gflops(self) -> float:
        """Training speed the simulator assumes: peak x utilisation (DEVICES.md §2)."""
        return self.peak_gflops_fp32 * self.utilisation

    @property
    def down_bps(self) -> float:
        return self.network.down_bps

    @property
    def up_bps(self) -> float:
        return self.network.up_bps

    @property
    def latency_s(self) -> float:
        return self.network.latency_s


def _board(
    name: str,
    description: str,
    ram_gib: float,
    budget_fraction: float,
    *,
    kind: str,
    compute_unit: str,
    peak_gflops_fp32: float,
    peak_derivation: str,
    utilisation: float,
    power_w: float,
    network: NetworkProfile,
    sources: tuple[str, ...],
) -> BoardClass:
    ram = int(ram_gib * GIB)
    return BoardClass(
        name=name,
        description=description,
        kind=kind,
        compute_unit=compute_unit,
        ram_bytes=ram,
        memory_budget_bytes=int(ram * budget_fraction),
        peak_gflops_fp32=peak_gflops_fp32,
        peak_derivation=peak_derivation,
        utilisation=utilisation,
        power_w=power_w,
        network=network,
        sources=sources,
    )


_DEVICES_MD = "shared/DEVICES.md"
_BOARDS = (
    _board(
        "rpi4",
        "Raspberry Pi 4 B, 4 GB (BCM2711, CPU training)",
        4,
        BOARD_BUDGET_FRACTION,
        kind="board",
        compute_unit="cpu",
        peak_gflops_fp32=48.0,
        peak_derivation="4 cores x 1.5 GHz x 8 FP32 FLOP/cycle (one 128-bit NEON FMA; R) = 48 D. "
        "Cross-check: HPL FP64 11.43 GFLOPS on the same SoC [2] -> FP32 GEMM ~22.9; 9.6 sustained is "
        '0.42 of that ("well under half", DEVICES.md §1 notes)',
        utilisation=CPU_UTILISATION,
        power_w=5.2,
        network=FIXED_BROADBAND,
        sources=(
            f"{_DEVICES_MD} §1 Raspberry Pi 4 B (A72 @1.5 GHz R; RAM 1/2/4/8 GB)",
            "[2] geerlingguy/top500-benchmark#33: CM4 HPL 11.43 GFLOPS at 5.2 W (V)",
        ),
    ),
    _board(
        "rpi5",
        "Raspberry Pi 5, 8 GB (BCM2712, CPU training)",
        8,
        BOARD_BUDGET_FRACTION,
        kind="board",
        compute_unit="cpu",
        peak_gflops_fp32=153.6,
        peak_derivation="4 cores x 2.4 GHz x 16 FP32 FLOP/cycle (2x128-bit FMA) = 153.6 (D/R, "
        "DEVICES.md §1). Cross-check: HPL FP64 30.25 [6] -> FP32 GEMM ~60.5; 30.7 sustained is 0.51 of it",
        utilisation=CPU_UTILISATION,
        power_w=11.0,
        network=FIXED_BROADBAND,
        sources=(
            f"{_DEVICES_MD} §1 Raspberry Pi 5 (4x A76 @2.4 GHz V[4]; RAM 2/4/8/16 GB V[4][5])",
            "[6] geerlingguy/top500-benchmark#18: HPL 30.25 GFLOPS at 11 W (V)",
        ),
    ),
    _board(
        "rpi3b",
        "Raspberry Pi 3 B, 1 GB (BCM2837, CPU training)",
        1,
        BOARD_BUDGET_FRACTION,
        kind="board",
        compute_unit="cpu",
        peak_gflops_fp32=19.2,
        peak_derivation="4 cores x 1.2 GHz x 4 FP32 FLOP/cycle (Cortex-A53: one 64-bit NEON FMA a cycle, "
        "the per-core rate phone-low uses for its A53s; R) = 19.2 D",
        utilisation=CPU_UTILISATION,
        power_w=4.0,
        network=FIXED_BROADBAND,
        sources=(
            "Raspberry Pi 3 B: 4x Cortex-A53 @1.2 GHz, 1 GB (raspberrypi.com product page, quoted in "
            "pietern/goestools#117: 'The Pi3 is 1.2GHz ... the Pi3's 1GB', R)",
            "4 W under load: typical of the board with a 2.5 A supply (R)",
        ),
    ),
    _board(
        "rpi-zero2w",
        "Raspberry Pi Zero 2 W, 512 MB (RP3A0 = BCM2710A1, CPU training)",
        0.5,
        BOARD_BUDGET_FRACTION,
        kind="board",
        compute_unit="cpu",
        peak_gflops_fp32=16.0,
        peak_derivation="4 cores x 1.0 GHz x 4 FP32 FLOP/cycle (Cortex-A53, as rpi3b; R) = 16 D",
        utilisation=CPU_UTILISATION,
        power_w=3.0,
        network=FIXED_BROADBAND,
        sources=(
            "Raspberry Pi Zero 2 W: quad-core Cortex-A53 @1 GHz, 512 MB LPDDR2 in the RP3A0 package "
            "(raspberrypi.com product page, quoted in TechnologyClassroom/RaspberryPiProgrammingWorkshop#19 "
            "and c0pperdragon/Amiga-Digital-Video#58, R)",
            "3 W under load: typical of the board (R)",
        ),
    ),
    _board(
        "jetson-nano-cpu",
        "Jetson Nano 4 GB training on its CPU (4x Cortex-A57; no CUDA build of PyTorch)",
        4,
        BOARD_BUDGET_FRACTION,
        kind="board",
        compute_unit="cpu",
        peak_gflops_fp32=45.76,
        peak_derivation="4 cores x 1.43 GHz x 8 FP32 FLOP/cycle (Cortex-A57: two 64-bit NEON FMA pipes, "
        "as the A72 of rpi4; R) = 45.76 D",
        utilisation=CPU_UTILISATION,
        power_w=10.0,
        network=FIXED_BROADBAND,
        sources=(
            f"{_DEVICES_MD} §1 Jetson Nano (4x Cortex-A57 @1.43 GHz R; 4 GB LPDDR4 V[9])",
            "power: 10 W maximum power mode (NVIDIA documentation, R)",
        ),
    ),
    _board(
        "jetson-nano",
        "Jetson Nano 4 GB (128-core Maxwell GPU, shared DRAM)",
        4,
        BOARD_BUDGET_FRACTION,
        kind="board",
        compute_unit="gpu",
        peak_gflops_fp32=236.0,
        peak_derivation="128 CUDA cores x 2 (FMA) x 0.9216 GHz = 236 D",
        utilisation=JETSON_GPU_UTILISATION,
        power_w=10.0,
        network=FIXED_BROADBAND,
        sources=(
            f"{_DEVICES_MD} §1 Jetson Nano (128 cores @921.6 MHz V[8][9]; 4 GB LPDDR4 V[9])",
            "power: 10 W maximum power mode (NVIDIA documentation, R)",
        ),
    ),
    _board(
        "jetson-xavier-nx",
        "Jetson Xavier NX 8 GB (384-core Volta GPU)",
        8,
        BOARD_BUDGET_FRACTION,
        kind="board",
        compute_unit="gpu",
        peak_gflops_fp32=845.0,
        peak_derivation="384 CUDA cores x 2 x 1.1 GHz = 845 D",
        utilisation=JETSON_GPU_UTILISATION,
        power_w=15.0,
        network=FIXED_BROADBAND,
        sources=(
            f"{_DEVICES_MD} §1 Jetson Xavier NX ([11] data sheet DA-09366-001: 384 cores "
            "@1100 MHz, 8 GB LPDDR4x, V)",
            "power: 15 W mode of the 10/15/20 W modes (NVIDIA documentation, R)",
        ),
    ),
    _board(
        "jetson-orin-nano",
        "Jetson Orin Nano 8 GB (1024-core Ampere GPU, non-Super clocks)",
        8,
        BOARD_BUDGET_FRACTION,
        kind="board",
        compute_unit="gpu",
        peak_gflops_fp32=1280.0,
        peak_derivation="1024 CUDA cores x 2 x 0.625 GHz = 1.28 TFLOPS D (Super clocks: 2.09)",
        utilisation=JETSON_GPU_UTILISATION,
        power_w=15.0,
        network=FIXED_BROADBAND,
        sources=(
            f"{_DEVICES_MD} §1 Jetson Orin Nano 8 GB ([14] data sheet: 1024 cores @625 MHz, "
            "8 GB LPDDR5, V); ~5-6 GB free with a desktop OS (R)",
            "power: 15 W of the 7/15/25 W modes (DEVICES.md §1 notes, R)",
        ),
    ),
    _board(
        "jetson-agx-orin",
        "Jetson AGX Orin 64 GB (2048-core Ampere GPU)",
        64,
        BOARD_BUDGET_FRACTION,
        kind="board",
        compute_unit="gpu",
        peak_gflops_fp32=5300.0,
        peak_derivation="5.3 FP32 TFLOPS, NVIDIA technical brief [18] (V)",
        utilisation=JETSON_GPU_UTILISATION,
        power_w=60.0,
        network=FIXED_BROADBAND,
        sources=(
            f"{_DEVICES_MD} §1 Jetson AGX Orin 64 GB ([18]: 2048 cores, 5.3 TFLOPS, V; 64 GB LPDDR5 R)",
            "[19] fixstars blog: 15-60 W (V); 60 W = MAXN",
        ),
    ),
    _board(
        "phone-low",
        "Low-end Android phone (Snapdragon 680 class, 4 GB)",
        4,
        PHONE_BUDGET_FRACTION,
        kind="phone",
        compute_unit="cpu",
        peak_gflops_fp32=107.2,
        peak_derivation="4x A73 @2.4 GHz x 8 + 4x A53 @1.9 GHz x 4 FP32 FLOP/cycle = 107.2 D "
        "(core mix and per-core FLOP/cycle R)",
        utilisation=CPU_UTILISATION,
        power_w=5.0,
        network=MOBILE,
        sources=(
            "nanoreview.net Snapdragon 680 pages: 8 cores, 2.4 GHz peak, 17 GB/s (R)",
            "RAM 4 GB and 5 W sustained: typical of the class (R)",
        ),
    ),
    _board(
        "phone-mid",
        "Mid-range Android phone (Snapdragon 778G class, 6 GB)",
        6,
        PHONE_BUDGET_FRACTION,
        kind="phone",
        compute_unit="cpu",
        peak_gflops_fp32=204.8,
        peak_derivation="A78 @2.4 + 3x A78 @2.2 GHz x 16 + 4x A55 @1.9 GHz x 8 FP32 FLOP/cycle "
        "= 204.8 D (per-core FLOP/cycle R)",
        utilisation=CPU_UTILISATION,
        power_w=5.0,
        network=MOBILE,
        sources=(
            'theregister.com 2021-05-19 "Qualcomm promises 5G 6nm Snapdragon 778G": 1x A78 '
            "@2.4 + 3x A78 @2.2 + 4x A55 @1.9 GHz (V)",
            "RAM 6 GB and 5 W sustained: typical of the class (R)",
        ),
    ),
    _board(
        "phone-high",
        "Flagship Android phone (Snapdragon 8 Gen 2, 8 GB)",
        8,
        PHONE_BUDGET_FRACTION,
        kind="phone",
        compute_unit="cpu",
        peak_gflops_fp32=329.6,
        peak_derivation="X3 @3.2 x 32 + 4x A715/A710 @2.8 x 16 + 3x A510 @2.0 x 8 FP32 FLOP/cycle "
        "= 329.6 D (per-core FLOP/cycle R); Qualcomm publishes no FP32 figure",
        utilisation=CPU_UTILISATION,
        power_w=5.0,
        network=MOBILE,
        sources=(
            f"{_DEVICES_MD} §1 Snapdragon 8 Gen 2 (core clocks V[20]; phones ship 8-16 GB R)",
            "5 W sustained: typical of the class (R)",
        ),
    ),
    _board(
        "laptop",
        "4-core x86 laptop, 16 GB (CPU training)",
        16,
        LAPTOP_BUDGET_FRACTION,
        kind="laptop",
        compute_unit="cpu",
        peak_gflops_fp32=384.0,
        peak_derivation="4 cores x 3.0 GHz x 32 FP32 FLOP/cycle (AVX2, 2 FMA ports; R) = 384 D. "
        "Cross-check: 2x the 2-core host measured in DEVICES.md §2 (~40 GFLOP/s) = 80",
        utilisation=CPU_UTILISATION,
        power_w=28.0,
        network=FIXED_BROADBAND,
        sources=(
            f"{_DEVICES_MD} §2 reference measurement: ResNet-18 CIFAR 12.1 samples/s "
            "(~40 GFLOP/s) on a 2-core Xeon (V)",
            "28 W: a typical thin-laptop CPU power limit (R)",
        ),
    ),
)

_REGISTERED: dict[str, BoardClass] = {board.name: board for board in _BOARDS}
# Every known class, shipped and registered (a read-only view: add classes with register_board).
BOARDS: MappingProxyType[str, BoardClass] = MappingProxyType(_REGISTERED)
_KINDS = ("board", "phone", "laptop")
_UNITS = ("cpu", "gpu")


def _check_board(board: BoardClass) -> None:
    """Refuse a class whose figures cannot describe a device, naming the field."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,63}", board.name):
        raise ConfigError(f"board class name {board.name!r}: lowercase letters, digits, '.', '_' or '-'")
    if board.kind not in _KINDS:
        raise ConfigError(f"board class {board.name}: kind must be one of {_KINDS}, got {board.kind!r}")
    if board.compute_unit not in _UNITS:
        raise ConfigError(
            f"board class {board.name}: compute_unit must be one of {_UNITS}, got {board.compute_unit!r}"
        )
    for field in ("ram_bytes", "memory_budget_bytes", "peak_gflops_fp32", "utilisation", "power_w"):
        value = getattr(board, field)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(
                f"board class {board.name}: {field} must be a positive finite number, got {value!r}"
            )
    if board.memory_budget_bytes > board.ram_bytes:
        raise ConfigError(f"board class {board.name}: memory_budget_bytes exceeds ram_bytes")
    if board.utilisation > 1:
        raise ConfigError(
            f"board class {board.name}: utilisation is a share of the peak (<= 1), got {board.utilisation}"
        )
    if not board.sources:
        raise ConfigError(f"board class {board.name}: give at least one source for its figures")


def register_board(board: BoardClass) -> BoardClass:
    """Add a class of device to the catalogue (emulation, trace generation, capacities by class); a name
    already taken by another class is refused."""
    _check_board(board)
    known = _REGISTERED.get(board.name)
    if known is not None and known != board:
        raise ConfigError(f"board class '{board.name}' is already in the catalogue")
    _REGISTERED[board.name] = board
    return board


def unregister_board(name: str) -> None:
    """Remove a registered class (shipped classes stay)."""
    if any(board.name == name for board in _BOARDS):
        raise ConfigError(f"board class '{name}' ships with Nestling and cannot be removed")
    _REGISTERED.pop(name, None)


def get_board(name: str) -> BoardClass:
    """The catalogue entry called `name`; a ConfigError lists the known names otherwise."""
    try:
        return BOARDS[name]
    except KeyError:
        raise ConfigError(f"[fleet] unknown board class '{name}' (known: {', '.join(BOARDS)})") from None


def catalogue_markdown_table() -> str:
    """The shipped catalogue as the Markdown table in docs/devices.md, so the page cannot drift."""
    header = (
        "| class | what | RAM | training budget | FP32 peak (GFLOP/s) | utilisation | "
        "sustained (GFLOP/s) | down / up (Mbit/s) | latency (ms) | power (W) |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = [
        f"| `{b.name}` | {b.description} | {b.ram_bytes / GIB:g} GiB | "
        f"{b.memory_budget_bytes / GIB:.2f} GiB | "
        f"{b.peak_gflops_fp32:g} | {b.utilisation:g} | {b.sustained_gflops:.1f} | "
        f"{b.down_bps / 1e6:g} / {b.up_bps / 1e6:g} | {b.latency_s * 1e3:g} | {b.power_w:g} |"
        for b in _BOARDS
    ]
    return header + "\n".join(rows) + "\n"
