"""Board classes for `nestling demo`: emulation-only classes slow enough that any host outruns four at once.

The shipped catalogue's slowest board (rpi4, 9.6 GFLOP/s sustained) is faster than what a loaded 2-core host
gives each of four agent processes training at once, so emulating it there only measures the host. These
classes are not real boards: they are slow (0.75-3 GFLOP/s sustained) so the host pads every board to exactly
its class's time, and one has little memory, so the demo shows both limits of the planner (profiler/fit.py).
Importing this module registers them (`NESTLING_PLUGINS=nestling.profiler.demo_boards`); the demo does that
for its agents.
"""

from __future__ import annotations

from nestling.profiler.catalogue import (
    BOARD_BUDGET_FRACTION,
    CPU_UTILISATION,
    FIXED_BROADBAND,
    BoardClass,
    register_board,
)

MIB = 2**20
_SOURCE = "emulation-only demo class (not a real board): figures chosen so a loaded 2-core host outruns it"


def _demo(
    name: str, description: str, sustained_gflops: float, ram_mib: int, budget_mib: float
) -> BoardClass:
    return BoardClass(
        name=name,
        description=description,
        kind="board",
        compute_unit="cpu",
        ram_bytes=ram_mib * MIB,
        memory_budget_bytes=int(budget_mib * MIB),
        peak_gflops_fp32=sustained_gflops / CPU_UTILISATION,
        peak_derivation=f"chosen: {sustained_gflops:g} GFLOP/s sustained at the catalogue's CPU utilisation",
        utilisation=CPU_UTILISATION,
        power_w=2.0,
        network=FIXED_BROADBAND,
        sources=(_SOURCE,),
    )


# Slowest first. Two fast classes that differ only in memory: the planner's memory limit decides between them.
DEMO_BOARDS = (
    _demo("demo-slow", "demo class: 0.75 GFLOP/s, 256 MiB", 0.75, 256, 256 * BOARD_BUDGET_FRACTION),
    _demo("demo-medium", "demo class: 1.5 GFLOP/s, 256 MiB", 1.5, 256, 256 * BOARD_BUDGET_FRACTION),
    _demo("demo-fast-lowmem", "demo class: 3 GFLOP/s, 32 MiB (21 MiB for training)", 3.0, 32, 21),
    _demo("demo-fast", "demo class: 3 GFLOP/s, 256 MiB", 3.0, 256, 256 * BOARD_BUDGET_FRACTION),
)

for _board in DEMO_BOARDS:
    register_board(_board)

__all__ = ["DEMO_BOARDS"]
