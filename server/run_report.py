"""Run outputs people look at (fleet and simulation alike): summary.json and accuracy per submodel vs round."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from nestling.plotting import pyplot
from nestling.server.plan_summary import summarise_plans
from nestling.strict_json import strict_dumps


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
    plt = pyplot()
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
    path.write_text(strict_dumps(summary, indent=2, sort_keys=True))
    return path


def smallest_submodel(submodels: list[dict[str, Any]]) -> dict[str, Any]:
    """METHODS' "worst" submodel: the smallest (fewest parameters, then MACs), the one the weakest board
    deploys; not the lowest score over submodels, which a larger submodel can hold early in training."""
    return min(submodels, key=lambda s: (s["parameters"], s.get("macs", 0)))


def summarise(records: list[dict[str, Any]], config: dict[str, Any], wall_seconds: float) -> dict[str, Any]:
    """summary.json: worst (smallest submodel) and average accuracy of the final evaluation, timing, submodels."""
    evaluated = [r for r in records if r.get("submodels")]
    final = evaluated[-1]["submodels"] if evaluated else []
    accuracies = [s["accuracy"] for s in final]
    smallest = smallest_submodel(final) if final else None
    # Local training = compute-seconds devices reported (summed over parallel workers); collect = wall time
    # the coordinator waited for results. Everything else in wall_seconds is coordination overhead.
    train_seconds = sum(r.get("local_train_seconds", 0.0) for r in records)
    collect_seconds = sum(r["collect_seconds"] for r in records)
    return {
        "method": config["method"]["name"],
        "model": config["model"]["arch"],
        "dataset": config["data"]["dataset"],
        "rounds": len(records),
        "worst_accuracy": smallest["accuracy"] if smallest is not None else None,
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


def board_accuracy(
    strategy: Any, devices: list[Any], evaluations: list[Any], last_round: int
) -> dict[str, Any] | None:
    """Each board's accuracy on the submodel it deploys (Strategy.deploy_spec), read from the final evaluation:
    the mean over boards and its spread (quartiles, IQR; FedTrans reports these, METHODS §4.a.6). Boards whose
    deployed submodel was not evaluated are counted, not guessed."""
    by_spec = {e.spec_id: e for e in evaluations}
    boards: dict[str, dict[str, Any]] = {}
    unevaluated = 0
    for device in sorted(devices, key=lambda d: d.device_id):
        evaluated = by_spec.get(strategy.deploy_spec(device, last_round).id)
        if evaluated is None:
            unevaluated += 1
            continue
        boards[device.device_id] = {"submodel": evaluated.name, "accuracy": evaluated.accuracy}
    if not boards:
        return None
    values = np.array([b["accuracy"] for b in boards.values()], dtype=float)
    q1, median, q3 = (float(q) for q in np.percentile(values, [25, 50, 75]))
    return {
        "mean": float(values.mean()),
        "q1": q1,
        "median": median,
        "q3": q3,
        "iqr": q3 - q1,
        "unevaluated": unevaluated,
        "boards": boards,
    }


def add_method_results(
    summary: dict[str, Any],
    strategy: Any,
    devices: list[Any],
    evaluations: list[Any],
    last_round: int,
    out_dir: Path,
) -> None:
    """What every run's summary adds after its rounds: the method's own report (`method_report`), each board's
    deployed-submodel accuracy (`boards`) and the method's own plots beside accuracy.png."""
    if method_summary := strategy.run_summary():
        summary["method_report"] = method_summary
    if (per_board := board_accuracy(strategy, devices, evaluations, last_round)) is not None:
        summary["boards"] = per_board
    plots = strategy.write_plots(out_dir, summary)
    if plots:
        summary["plots"] = sorted(str(path.name) for path in plots)
