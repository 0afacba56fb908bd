"""A board's capacity T_c for FedTrans (METHODS §4.a.2 step 2): the forward MACs per sample it can afford.

FedTrans sizes its seed model for the weakest client and grows models up to the strongest client's capacity;
a client trains only models whose MACs fit T_c (K_c). The paper reads T_c from FedScale's device traces, a
compute figure; here, in order of precedence:

1. `profile["budget"]["macs"]`: a board that states its capacity in MACs.
2. Its sustained training speed: an emulating agent's advertised `gflops`, or the board catalogue's figure
   for the trace's `device_class` (replay). T_c = MACs(seed) × speed / speed(reference board), so a board
   k times faster than the reference (default the catalogue's slowest, rpi4) affords a k times costlier model
   in the same round time, and the reference board exactly the seed model.
3. A tier pinned by the enrolment (`device.tier`), else equal contiguous tiers by client index: `capacities` are multiples of the
   seed model's MACs (default 1…32, the ≥29× spread of METHODS §4.c's small-scale target).

A registered memory budget is a second, independent limit: a model is compatible only if its estimated
training memory also fits (checked by the strategy, which knows each model's cost).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nestling.errors import ConfigError
from nestling.profiler.catalogue import BOARDS, get_board
from nestling.profiler.planner import device_memory_budget
from nestling.server.strategies.base import DeviceInfo

SOURCES = ("budget", "speed", "tier")


@dataclass(frozen=True)
class Capacity:
    """T_c in forward MACs per sample, the memory budget if one was registered, and where T_c came from."""

    macs: float
    memory_bytes: int | None
    source: str

    def to_list(self) -> list[Any]:
        return [self.macs, self.memory_bytes, self.source]

    @classmethod
    def from_list(cls, row: list[Any]) -> Capacity:
        macs, memory, source = row
        return cls(float(macs), None if memory is None else int(memory), str(source))


def validated_tiers(tiers: tuple[float, ...]) -> list[float]:
    """The `capacities` option: a non-empty list of positive multiples of the seed model's MACs."""
    if not tiers or any(c <= 0 for c in tiers):
        raise ConfigError(
            f"[method] fedtrans capacities must be a non-empty list of numbers > 0 (multiples of the seed "
            f"model's MACs), got {list(tiers)!r}"
        )
    return [float(c) for c in tiers]


def reference_gflops(name: str) -> float:
    """Sustained training speed of the board the seed model is sized for (the `capacity_reference` option)."""
    return get_board(name).sustained_gflops


def device_gflops(profile: dict[str, Any] | None) -> float | None:
    """A board's sustained training speed from its profile: emulated figures first, then its catalogue class."""
    profile = profile or {}
    emulating = profile.get("emulating")
    if isinstance(emulating, dict):
        gflops = emulating.get("gflops")
        if isinstance(gflops, (int, float)) and not isinstance(gflops, bool) and gflops > 0:
            return float(gflops)
    board = BOARDS.get(str(profile.get("device_class")))
    return None if board is None else board.sustained_gflops


def capacity_of(
    device: DeviceInfo, seed_macs: float, tiers: list[float], num_clients: int, reference: float
) -> Capacity:
    """T_c of `device` (see the module docstring for the order of sources)."""
    memory = device_memory_budget(device.memory_budget_bytes, device.profile)
    profile = device.profile or {}
    declared = (profile.get("budget") or {}).get("macs")
    if isinstance(declared, (int, float)) and not isinstance(declared, bool) and declared > 0:
        return Capacity(float(declared), memory, "budget")
    gflops = device_gflops(profile)
    if gflops is not None:
        return Capacity(seed_macs * gflops / reference, memory, "speed")
    if device.tier is not None:
        tier = device.tier
    else:
        per_tier = max(1.0, num_clients / len(tiers))
        tier = int(device.index // per_tier)
    return Capacity(seed_macs * tiers[min(max(tier, 0), len(tiers) - 1)], memory, "tier")
