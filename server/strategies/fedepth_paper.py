"""FeDepth's stages as the paper trains them: the greedy rule over the paper's own memory table (METHODS §3.a.2).

The reference code hard-codes PreResNet-20 stages that the rule reproduces from Table 1 (per-block MB, R(r)):
r = 1/6 → [B1][B2][B3][B4][B5,B6][B7,B8,B9], 1/3 → [B1,B2][B3,B4][B5..B9], 1/2 → [B1,B2,B3][B4..B9],
1 → one stage, 1/8 → B1–B3 bypassed, [B4][B5][B6][B7,B8][B9]. The table leaves the stem and head out, so
these stages can exceed Nestling's measured R(r) (docs/methods-decisions.md); `plan = "paper"` exists to
compare with the paper, the memory plan stays the default.
"""

from __future__ import annotations

from nestling.errors import ConfigError
from nestling.profiler.decompose import PAPER_BLOCK_MB, PAPER_WIDTH_MB, StagePlan, greedy_stages

PAPER_ARCH = "preresnet20"  # Table 1 is FeDepth's PreResNet-20 (METHODS §1.5)


def paper_ratio(ratio: float) -> float | None:
    """The Table 1 width ratio `ratio` names (1/6 given as 0.166667 included); None when the table lacks it."""
    return next((known for known in PAPER_WIDTH_MB if abs(known - ratio) <= 1e-4 * known), None)


def paper_stages(arch: str, ratio: float, tolerance: float) -> StagePlan:
    """The paper's stages for one model within R(ratio); ratio ≥ 1 holds the whole model (one stage)."""
    if arch != PAPER_ARCH:
        raise ConfigError(
            f"plan = 'paper' is the FeDepth paper's PreResNet-20 table (METHODS §3.a.1); '{arch}' has none: "
            "use plan = 'memory'"
        )
    if ratio >= 1.0 - 1e-9:
        return StagePlan((tuple(range(len(PAPER_BLOCK_MB))),))
    known = paper_ratio(ratio)
    if known is None:
        names = ", ".join(f"{r:.4g}" for r in sorted(PAPER_WIDTH_MB))
        raise ConfigError(
            f"the FeDepth paper has no stages for budget ×{ratio:g} (its table: {names}, or ≥ 1): "
            "use plan = 'memory'"
        )
    return greedy_stages(PAPER_BLOCK_MB, PAPER_WIDTH_MB[known], tolerance)


def paper_plan(
    arch: str, ratio: float, tolerance: float, max_models: int, mutual_depthwise: bool
) -> tuple[StagePlan, int]:
    """Stages and number of models (m-FeDepth, §3.a.7) for budget ×ratio: M models share it as ×ratio/M
    each, taken only when every model gets stages without bypass — a single stage (the reference's surplus
    clients: ×2 holds two full models), or any stages with `mutual_depthwise`."""
    for models in range(max_models, 1, -1):
        try:
            plan = paper_stages(arch, ratio / models, tolerance)
        except ConfigError:
            continue
        if not plan.bypass and (plan.num_stages == 1 or mutual_depthwise):
            return plan, models
    return paper_stages(arch, ratio, tolerance), 1
