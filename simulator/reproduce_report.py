"""A reproduction's result table (markdown + JSON) and accuracy-over-rounds plot with one band per method."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from nestling.plotting import pyplot
from nestling.simulator.reproduce import Comparison, RunResult, Spread, Verdict
from nestling.strict_json import strict_dumps


def _cell(spread: Spread) -> str:
    if spread.n == 0 or math.isnan(spread.mean):
        return "–"
    return f"{spread.mean:.2f} ± {spread.std:.2f}" if spread.n > 1 else f"{spread.mean:.2f}"


def _si(value: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {suffix}"
    return f"{value:.3g}"


def compute_cells(runs: list[RunResult]) -> tuple[str, str]:
    """Steps and training MACs per client-round over a method's runs: mean (min–max), or – when not recorded."""
    recorded = [r.compute for r in runs if r.compute]
    if not recorded:
        return "–", "–"
    weights = [c["client_rounds"] for c in recorded]

    def cell(key: str, fmt: Any) -> str:
        mean = sum(c[f"{key}_mean"] * w for c, w in zip(recorded, weights)) / sum(weights)
        low, high = min(c[f"{key}_min"] for c in recorded), max(c[f"{key}_max"] for c in recorded)
        return fmt(mean) if low == high else f"{fmt(mean)} ({fmt(low)}–{fmt(high)})"

    return cell("steps", lambda v: f"{v:.3g}"), cell("macs", _si)


def refused_cell(runs: list[RunResult]) -> str:
    """'0', or the refusals over a method's runs by counter: '3 (rejected_update_cohort 3)'; '–' without runs
    (no run is not a run that refused nothing)."""
    if not runs:
        return "–"
    total: dict[str, int] = {}
    for run in runs:
        for key, value in run.refused.items():
            total[key] = total.get(key, 0) + value
    count = sum(total.values())
    if not count:
        return "0"
    return f"{count} (" + ", ".join(f"{key} {value}" for key, value in sorted(total.items())) + ")"


def markdown(
    comparison: Comparison,
    table: dict[str, dict[str, Spread]],
    verdicts: list[Verdict],
    runs: list[RunResult],
    command: str,
) -> str:
    """The table a reviewer reads: measured mean ± std over seeds beside the paper's figure and each method's
    local compute per client-round, then every claim judged per seed, paired."""
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
    tail = ["seeds", "steps / client-round", "train MACs / client-round", "refused", "wall min"]
    lines += ["", "| " + " | ".join([*header, *tail]) + " |", "|" + "---|" * (len(header) + len(tail))]
    for entry in comparison.entries:
        mine = [r for r in runs if r.label == entry.label]
        wall = sum(r.wall_seconds for r in mine) / 60.0
        cells = [_cell(table[entry.label][m]) for m in comparison.metrics]
        cells += [f"{entry.paper[m]:.2f}" if m in entry.paper else "–" for m in comparison.metrics]
        steps, macs = compute_cells(mine)
        own_seeds = ",".join(str(r.seed) for r in sorted(mine, key=lambda r: r.seed)) or "–"
        refused = refused_cell(mine)
        minutes = f"{wall:.1f}" if mine else "–"
        lines.append(
            "| " + " | ".join([entry.label, *cells, own_seeds, steps, macs, refused, minutes]) + " |"
        )
    trained = [r for r in sorted(runs, key=lambda r: (r.label, r.seed)) if r.trained]
    if trained:
        lines += ["", "What the boards trained:"]
        lines += [f"- {r.label}, seed {r.seed}: {r.trained}" for r in trained]
    lines += [
        "",
        "Compute: optimizer steps each board reported and 3 × forward MACs × samples of the task's model, per "
        "client-round, mean (min–max) over every delivered result (FeDepth's stages over-counted, DynamicFL's "
        "on-board branches not counted: simulator/reproduce_compute.py). Refused: results the server's screens "
        "refused over all seeds, by reason; these runs have no attacker, so any is an honest board refused.",
        "",
        "Claims are judged per seed, paired (same seed = same partition, initial weights and draws), on the seeds "
        "both methods finished: *clear* = ahead on every paired seed and the mean paired margin exceeds the "
        "standard deviation of the paired margins.",
        "",
        "| claim | margin per seed (pts) | paired margin | paired spread | held | every seed | clear |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        per_seed = (
            ", ".join(f"{seed}: {m:+.2f}" for seed, m in sorted(v.margins.items())) or "– (no common seed)"
        )
        spread = "– (one seed)" if v.seeds == 1 else "–" if v.seeds == 0 else f"{v.spread:.2f}"
        margin = "–" if v.seeds == 0 else f"{v.margin:+.2f}"
        lines.append(
            f"| {v.claim} | {per_seed} | {margin} | {spread} | {'yes' if v.held else 'no'} | "
            f"{'yes' if v.every_seed else 'no'} | {'yes' if v.clear else 'no'} |"
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
                    {
                        "seed": r.seed,
                        "final": r.final,
                        "wall_seconds": r.wall_seconds,
                        "rounds": r.rounds,
                        "compute": r.compute,
                        "refused": r.refused,
                        "trained": r.trained,
                    }
                    for r in runs
                    if r.label == entry.label
                ],
            }
            for entry in comparison.entries
        },
        "verdict_rule": "paired per seed: clear = ahead on every common seed and mean margin > std of margins",
        "claims": [
            {
                "claim": str(v.claim),
                "margins": {str(seed): m for seed, m in sorted(v.margins.items())},
                "margin": v.margin,
                "spread": v.spread,
                "seeds": v.seeds,
                "held": v.held,
                "every_seed": v.every_seed,
                "clear": v.clear,
            }
            for v in verdicts
        ],
    }


def plot(comparison: Comparison, runs: list[RunResult], path: Path) -> Path:
    """Accuracy over rounds per metric: the mean over seeds as a line, min..max over seeds as a band."""
    plt = pyplot()

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
