"""Run outputs people look at (fleet and simulation alike): summary.json and accuracy per submodel vs round."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

from nestling.server.plan_summary import summarise_plans

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def read_metrics(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_accuracy(out_dir: Path, title: str) -> Path:
    """accuracy.png: one line per submodel over the evaluated rounds."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in read_metrics(out_dir):
        for sub in record.get("submodels", []):
            series.setdefault(sub["name"], []).append((record["round"] + 1, sub["accuracy"]))
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for name, points in series.items():
        xs, ys = zip(*points)
        ax.plot(xs, [100 * y for y in ys], marker="o", markersize=3, label=name)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "accuracy.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def write_summary(out_dir: Path, summary: dict[str, Any]) -> Path:
    path = out_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2, sort_keys=True))
    return path


def summarise(records: list[dict[str, Any]], config: dict[str, Any], wall_seconds: float) -> dict[str, Any]:
    """summary.json: worst/avg accuracy of the final evaluation, timing split, and every submodel."""
    evaluated = [r for r in records if r.get("submodels")]
    final = evaluated[-1]["submodels"] if evaluated else []
    accuracies = [s["accuracy"] for s in final]
    # Local training = compute-seconds devices reported (summed over parallel workers); collect = wall time
    # the coordinator waited for results. Everything else in wall_seconds is coordination overhead.
    train_seconds = sum(r.get("local_train_seconds", 0.0) for r in records)
    collect_seconds = sum(r["collect_seconds"] for r in records)
    return {
        "method": config["method"]["name"],
        "model": config["model"]["arch"],
        "dataset": config["data"]["dataset"],
        "rounds": len(records),
        "worst_accuracy": min(accuracies) if accuracies else None,
        "avg_accuracy": sum(accuracies) / len(accuracies) if accuracies else None,
        "train_seconds": train_seconds,
        "wall_seconds": wall_seconds,
        "collect_seconds": collect_seconds,
        "overhead_seconds": wall_seconds - collect_seconds,
        "wall_over_train": wall_seconds / train_seconds if train_seconds else None,
        "virtual_seconds": records[-1]["virtual_time"] if records else 0.0,
        "bytes_down": sum(r["bytes_down"] for r in records),
        "bytes_up": sum(r["bytes_up"] for r in records),
        "submodels": [
            {
                "id": s["spec_id"],
                "name": s["name"],
                "accuracy": s["accuracy"],
                "loss": s["loss"],
                "parameters": s["parameters"],
                "macs": s["macs"],
            }
            for s in final
        ],
        "config": config,
        **summarise_plans(records),  # per-board plans and re-plans, when boards were planned from profiles
    }
