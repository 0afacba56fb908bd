"""NeFL submodel families (METHODS §2.a.8): width ratios ρ_k and kept-block masks per architecture."""

from __future__ import annotations

import math

from nestling.errors import ConfigError
from nestling.models.zoo import CONV_FAMILIES, VIT_DEFAULTS
from nestling.spec import width_from_param_fraction

Family = list[tuple[float, tuple[int, ...] | None]]  # (channel ratio ρ, kept block indices or None = all)

PARAM_FRACTIONS = (0.2, 0.4, 0.6, 0.8, 1.0)  # γ of the five submodels in NeFL's main experiments
_W_GAMMAS = PARAM_FRACTIONS


def _stage_depths(arch: str, extra: dict | None = None) -> tuple[int, ...]:
    if arch in CONV_FAMILIES:
        return CONV_FAMILIES[arch].stage_depths
    if arch == "vit":
        return ({**VIT_DEFAULTS, **(extra or {})}["depth"],)
    raise ConfigError(f"[model] no NeFL family for model '{arch}'")


def _from_stage_masks(masks: list[list[int]]) -> tuple[int, ...]:
    kept, index = [], 0
    for stage in masks:
        for bit in stage:
            if bit:
                kept.append(index)
            index += 1
    return tuple(kept)


def _first_n(depths: tuple[int, ...], per_stage: tuple[int, ...]) -> tuple[int, ...]:
    kept, offset = [], 0
    for depth, n in zip(depths, per_stage):
        kept.extend(range(offset, offset + min(n, depth)))
        offset += depth
    return tuple(kept)


_D_MASKS = {
    "resnet18": [[[1, 1], [0, 0], [1, 1], [0, 0]], [[1, 1], [1, 1], [0, 0], [1, 0]], [[1, 1], [1, 1], [1, 1], [1, 0]],
                 [[1, 0], [1, 1], [0, 0], [1, 1]]],
    "resnet34": [[[1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 0, 0]],
                 [[1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0, 0, 1], [1, 0, 0]],
                 [[1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0, 0, 1], [1, 0, 1]],
                 [[1, 1, 1], [1, 0, 0, 1], [1, 1, 0, 0, 0, 1], [1, 1, 1]]],
}
_D_FIRST_N = {"resnet56": [(2, 2, 2), (3, 3, 4), (4, 4, 6), (9, 8, 7)],
              "resnet110": [(16, 4, 3), (14, 7, 7), (17, 13, 10), (16, 16, 14)]}
_WD = {
    "resnet18": ((0.34, 0.4, 0.6, 0.8, 1.0), [[[1, 1], [1, 1], [1, 1], [1, 0]]]),
    "resnet34": ((0.378296, 0.625390, 0.770943, 0.899801, 1.0),
                 [[[1, 1, 1], [1, 0, 0, 1], [1, 0, 0, 0, 0, 1], [1, 0, 1]],
                  [[1, 1, 1], [1, 0, 0, 1], [1, 1, 1, 0, 0, 1], [1, 0, 1]],
                  [[1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1, 0, 1], [1, 0, 1]],
                  [[1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0, 0, 1], [1, 1, 1]]]),
}
_WD_FIRST_N = {"resnet56": ((0.464938, 0.607812, 0.777136, 0.902901, 1.0), (4, 6, 7, 8, 9)),
               "resnet110": ((0.457253, 0.603831, 0.774235, 0.901430, 1.0), (8, 12, 14, 16, 18))}


def _generic_depth(depths: tuple[int, ...], fraction: float) -> tuple[int, ...]:
    """For models without a published family: keep the first ⌈f·n⌉ blocks of every stage (≥ 1)."""
    return _first_n(depths, tuple(max(1, math.ceil(fraction * d - 1e-9)) for d in depths))


def nefl_family(arch: str, mode: str, extra: dict | None = None) -> Family:
    """Five submodels, smallest first, for NeFL-W / NeFL-D / NeFL-WD on `arch`."""
    depths = _stage_depths(arch, extra)
    if mode == "w":
        return [(width_from_param_fraction(g), None) for g in _W_GAMMAS]
    if mode == "d":
        if arch in _D_MASKS:
            return [(1.0, _from_stage_masks(m)) for m in _D_MASKS[arch]] + [(1.0, None)]
        if arch in _D_FIRST_N:
            return [(1.0, _first_n(depths, n)) for n in _D_FIRST_N[arch]] + [(1.0, None)]
        return [(1.0, _generic_depth(depths, g)) for g in _W_GAMMAS[:-1]] + [(1.0, None)]
    if mode == "wd":
        if arch in _WD:
            gammas, masks = _WD[arch]
            kept = [_from_stage_masks(m) for m in masks] + [None] * (5 - len(masks))
            return [(width_from_param_fraction(g), k) for g, k in zip(gammas, kept)]
        if arch in _WD_FIRST_N:
            gammas, per_stage = _WD_FIRST_N[arch]
            return [(width_from_param_fraction(g), _first_n(depths, (n,) * len(depths)) if n < max(depths) else None)
                    for g, n in zip(gammas, per_stage)]
        # Generic: split γ evenly between width and depth (γ_W = γ_D = √γ).
        return [(width_from_param_fraction(math.sqrt(g)), None if g == 1.0 else _generic_depth(depths, math.sqrt(g)))
                for g in _W_GAMMAS]
    raise ConfigError(f"[method] unknown NeFL mode '{mode}' (known: w, d, wd)")
