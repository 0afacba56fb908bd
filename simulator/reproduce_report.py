"""A reproduction's result table (markdown + JSON) and accuracy-over-rounds plot with one band per method."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from nestling.simulator.reproduce import Comparison, RunResult, Spread, Verdict
from nestling.strict_json import strict_dumps


def _cell(spread: Spread) -> str:
    if spread.n == 0 or math.isnan(spread.mean):
        return "–"
    return f"{spread.mean:.2f} ± {spread.std:.2f}" if spread.n > 1 else f"{spread.mean:.2f}"


def markdown(
    comparison: Comparison,
    table: dict[str, dict[str, Spread]],
    verdicts: list[Verdict],
    runs: list[RunResult],
    command: str,
) -> str:
    """The table a reviewer reads: measured mean ± std over seeds beside the paper's figure, then the claims."""
    seeds = sorted({r.seed for r in runs})
    lines = [
        f"## {comparison.title} — scale `{comparison.scale}`",
        "",
        f"Source: {comparison.source}. Seeds: {', '.join(map(str, seeds))}. Command: `{command}`",
    ]
    if comparison.note:
        lines += ["", comparison.note]
    header = (
        ["method"]
        + [f"{m} (ours)" for m in comparison.metrics]
        + [f"{m} (paper)" for m in comparison.metrics]
    )
    lines += ["", "| " + " | ".join([*header, "wall min"]) + " |", "|" + "---|" * (len(header) + 1)]
    for entry in comparison.entries:
        mine = [r for r in runs if r.label == entry.label]
        wall = sum(r.wall_seconds for r in mine) / 60.0
        cells = [_cell(table[entry.label][m]) for m in comparison.metrics]
        cells += [f"{entry.paper[m]:.2f}" if m in entry.paper else "–" for m in comparison.metrics]
        lines.append("| " + " | ".join([entry.label, *cells, f"{wall:.1f}"]) + " |")
    lines += ["", "| claim | margin (pts) | seed spread | held | beyond spread |", "|---|---|---|---|---|"]
    for v in verdicts:
        spread = "– (one seed)" if v.seeds < 2 else f"{v.spread:.2f}"
        lines.append(
            f"| {v.claim} | {v.margin:+.2f} | {spread} | {'yes' if v.held else 'no'} | "
            f"{'yes' if v.clear else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def as_json(
    comparison: Comparison,
    table: dict[str, dict[str, Spread]],
    verdicts: list[Verdict],
    runs: list[RunResult],
) -> dict[str, Any]:
    return {
        "name": comparison.name,
        "scale": comparison.scale,
        "source": comparison.source,
        "methods": {
            entry.label: {
                "method": entry.method,
                "options": entry.options,
                "paper": entry.paper,
                "measured": {
                    m: {"mean": s.mean, "std": s.std, "seeds": s.n} for m, s in table[entry.label].items()
                },
                "runs": [
                    {"seed": r.seed, "final": r.final, "wall_seconds": r.wall_seconds, "rounds": r.rounds}
                    for r in runs
                    if r.label == entry.label
                ],
            }
            for entry in comparison.entries
        },
        "claims": [
            {"claim": str(v.claim), "margin": v.margin, "spread": v.spread, "held": v.held, "clear": v.clear}
            for v in verdicts
        ],
    }


def plot(comparison: Comparison, runs: list[RunResult], path: Path) -> Path:
    """Accuracy over rounds per metric: the mean over seeds as a line, min..max over seeds as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = comparison.metrics
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.0 * len(metrics), 3.6), squeeze=False)
    for axis, metric in zip(axes[0], metrics):
        for entry in comparison.entries:
            curves = [dict(r.curve[metric]) for r in runs if r.label == entry.label]
            if not curves:
                continue
            rounds = sorted(set.intersection(*(set(c) for c in curves)))
            if not rounds:
                continue
            means = [statistics.fmean(c[x] for c in curves) for x in rounds]
            (line,) = axis.plot(rounds, means, label=entry.label)
            if len(curves) > 1:
                low = [min(c[x] for c in curves) for x in rounds]
                high = [max(c[x] for c in curves) for x in rounds]
                axis.fill_between(rounds, low, high, alpha=0.2, color=line.get_color())
        axis.set_title(f"{metric} submodel" if metric in ("worst", "avg") else metric)
        axis.set_xlabel("round")
        axis.set_ylabel("test accuracy (%)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(f"{comparison.title} ({comparison.scale})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_results(
    out_dir: Path,
    comparison: Comparison,
    table: dict[str, dict[str, Spread]],
    verdicts: list[Verdict],
    runs: list[RunResult],
    command: str,
) -> dict[str, Path]:
    """results.md, results.json and accuracy.png in the reproduction's folder."""
    paths = {
        "markdown": out_dir / "results.md",
        "json": out_dir / "results.json",
        "plot": out_dir / "accuracy.png",
    }
    paths["markdown"].write_text(markdown(comparison, table, verdicts, runs, command))
    paths["json"].write_text(strict_dumps(as_json(comparison, table, verdicts, runs), indent=2) + "\n")
    plot(comparison, runs, paths["plot"])
    return paths
