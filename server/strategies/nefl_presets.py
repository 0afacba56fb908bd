"""NeFL submodel families (METHODS §2.a.8): width ratios ρ_k and kept-block masks, asked of each model family.

A model family with published NeFL masks answers `nefl_depth_preset` / `nefl_wd_preset`
(nestling/models/family.py); any other family gets the generic rule below.
"""

from __future__ import annotations

import math

from nestling.errors import ConfigError
from nestling.models.family import family_of, first_n_per_stage
from nestling.spec import width_from_param_fraction

Family = list[tuple[float, tuple[int, ...] | None]]  # (channel ratio ρ, kept block indices or None = all)

PARAM_FRACTIONS = (0.2, 0.4, 0.6, 0.8, 1.0)  # γ of the five submodels in NeFL's main experiments
_W_GAMMAS = PARAM_FRACTIONS


def _generic_depth(depths: tuple[int, ...], fraction: float) -> tuple[int, ...]:
    """For models without a published family: keep the first ⌈f·n⌉ blocks of every stage (≥ 1)."""
    return first_n_per_stage(depths, tuple(max(1, math.ceil(fraction * d - 1e-9)) for d in depths))


def nefl_family(arch: str, mode: str, extra: dict | None = None) -> Family:
    """Five submodels, smallest first, for NeFL-W / NeFL-D / NeFL-WD on `arch`."""
    family = family_of(arch)
    depths = family.stage_depths(extra or {})
    if mode == "w":
        return [(width_from_param_fraction(g), None) for g in _W_GAMMAS]
    if mode == "d":
        published = family.nefl_depth_preset()
        if published is not None:
            return [(1.0, kept) for kept in published] + [(1.0, None)]
        return [(1.0, _generic_depth(depths, g)) for g in _W_GAMMAS[:-1]] + [(1.0, None)]
    if mode == "wd":
        preset = family.nefl_wd_preset()
        if preset is not None:
            return [(width_from_param_fraction(g), kept) for g, kept in preset]
        # Generic: split γ evenly between width and depth (γ_W = γ_D = √γ).
        return [
            (
                width_from_param_fraction(math.sqrt(g)),
                None if g == 1.0 else _generic_depth(depths, math.sqrt(g)),
            )
            for g in _W_GAMMAS
        ]
    raise ConfigError(f"[method] unknown NeFL mode '{mode}' (known: w, d, wd)")
