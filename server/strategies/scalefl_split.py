"""ScaleFL's 2-D split search: the most balanced (s_w, s_d) meeting each level's cost (METHODS §6.a.2)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from nestling.errors import ConfigError
from nestling.models.config import ModelConfig
from nestling.profiler.trace import part_params
from nestling.spec import SubmodelSpec


@dataclass(frozen=True)
class Level:
    """One complexity level: width ratio, depth (blocks kept) and the relative cost reached."""

    width: float
    depth: int
    cost_ratio: float


@lru_cache(maxsize=4096)
def _group_params(
    probe: ModelConfig, width: float
) -> tuple[float, tuple[float, ...], tuple[float, ...], float]:
    """Parameters of stem, of each block, of an exit after each block, and of the head at `width`.

    Counted on a meta-device build (profiler/trace.py's `part_params`: no weights drawn, nothing run); the
    search costs a hundred widths."""
    blocks = max(probe.exit_points) + 1
    block_params, exit_params = np.zeros(blocks), np.zeros(blocks)
    stem = head = 0.0
    for record in part_params(SubmodelSpec(probe, width=width, exits=probe.exit_points)):
        if record.kind == "block" and record.index is not None:
            block_params[record.index] += record.params
        elif record.kind == "exit" and record.index is not None:
            exit_params[record.index] += record.params
        elif record.kind == "stem":
            stem += record.params
        elif record.kind == "head":
            head += record.params
    return stem, tuple(block_params), tuple(exit_params), head


def search_levels(
    model: ModelConfig,
    fractions: tuple[float, ...],
    *,
    num_blocks: int,
    step: float = 0.01,
    tolerance: float = 0.05,
) -> list[Level]:
    """Levels smallest first; the last fraction must be 1 (the full model). Cost = #params incl. kept exits."""
    probe = model.with_(exit_points=tuple(range(num_blocks)))
    widths = [round(step * i, 4) for i in range(1, round(1 / step) + 1)]
    depths = [int(np.floor(ratio * num_blocks + 1e-9)) for ratio in widths]
    stem, blocks, exits, head = _group_params(probe, 1.0)
    backbone = stem + sum(blocks) + head  # parameter counts are integers: float sums are exact in any order
    levels: list[Level] = []
    chosen_exits: list[int] = []
    for fraction in fractions[:-1]:
        best: tuple[float, float, float, int, float] | None = None  # balance, error, width, depth, ratio
        fallback: tuple[float, float, int, float] | None = None  # error, width, depth, ratio
        chosen_full = sum(exits[e] for e in chosen_exits)
        for width in widths:
            w_stem, w_blocks, w_exits, _ = _group_params(probe, width)
            prefix = list(itertools.accumulate(w_blocks))
            kept_exit_cost = sum(w_exits[e] for e in chosen_exits)
            for depth_ratio, depth in zip(widths, depths):
                if depth < 1 or (chosen_exits and depth - 1 <= chosen_exits[-1]):
                    continue
                cost = w_stem + prefix[depth - 1] + kept_exit_cost + w_exits[depth - 1]
                full_cost = backbone + chosen_full + exits[depth - 1]
                error = abs(cost / (fraction * full_cost) - 1)
                if error <= tolerance:
                    balance = abs(width - depth_ratio)
                    if best is None or (balance, error) < best[:2]:
                        best = (balance, error, width, depth, cost / full_cost)
                elif fallback is None or error < fallback[0]:
                    fallback = (error, width, depth, cost / full_cost)
        if best is not None:
            picked = Level(*best[2:])
        elif fallback is not None:
            picked = Level(*fallback[1:])
        else:
            raise ConfigError(
                f"[method] ScaleFL level {len(levels) + 1} (cost {fraction:g}) has no split: "
                f"{model.arch} has too few blocks ({num_blocks}) for {len(fractions)} levels "
                "that each end at a later block"
            )
        levels.append(picked)
        chosen_exits.append(picked.depth - 1)
    levels.append(Level(1.0, num_blocks, 1.0))
    return levels


def explicit_levels(grid: Any, *, num_blocks: int) -> list[Level]:
    """Levels given as [[width, depth], ...] below the full model (what `nestling plan --method scalefl`
    derives from measured memory budgets); the full model is appended as the top level."""
    if not isinstance(grid, (list, tuple)) or not grid:
        raise ConfigError(f"[method] ScaleFL grid must be a list of [width, depth] pairs, got {grid!r}")
    levels: list[Level] = []
    for pair in grid:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise ConfigError(f"[method] ScaleFL grid entries are [width, depth] pairs, got {pair!r}")
        width, depth = pair
        if isinstance(width, bool) or not isinstance(width, (int, float)) or not 0 < float(width) <= 1:
            raise ConfigError(f"[method] ScaleFL grid width must be in (0, 1], got {width!r}")
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= num_blocks:
            raise ConfigError(
                f"[method] ScaleFL grid depth must be an integer in [1, {num_blocks}] "
                f"(blocks kept; the full model is added on top), got {depth!r}"
            )
        if levels and depth <= levels[-1].depth:
            raise ConfigError(
                f"[method] ScaleFL grid depths must rise (each level exits after a later block), "
                f"got {depth} after {levels[-1].depth}"
            )
        levels.append(Level(float(width), depth, float("nan")))  # cost unknown: chosen by memory, not params
    levels.append(Level(1.0, num_blocks, 1.0))
    return levels


@dataclass(frozen=True)
class LevelBudget:
    """Where a level's parameters go: its backbone (stem and kept blocks) and the exit heads it carries."""

    level: Level
    backbone: int
    exits: int

    @property
    def exit_share(self) -> float:
        return self.exits / (self.backbone + self.exits)


def level_budgets(model: ModelConfig, levels: list[Level], *, num_blocks: int) -> list[LevelBudget]:
    """Split each level below the full model into backbone and exit parameters. On a shallow network the
    exit heads (three 3×3 convs at the stage's width, §6.a.4) take a large share of a small level's budget,
    which leaves its backbone fewer parameters than a width-only submodel of the same size."""
    probe = model.with_(exit_points=tuple(range(num_blocks)))
    budgets: list[LevelBudget] = []
    exits_so_far: list[int] = []
    for level in levels[:-1]:
        stem, blocks, exits, _ = _group_params(probe, level.width)
        exits_so_far.append(level.depth - 1)
        backbone = stem + sum(blocks[: level.depth])
        budgets.append(LevelBudget(level, round(backbone), round(sum(exits[e] for e in exits_so_far))))
    return budgets
