"""growth.png: how a FedTrans family grew (models by birth round and MACs, parent edges) beside their accuracy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nestling.plotting import pyplot


def plot_growth(
    out_dir: Path, models: list[dict[str, Any]], evaluated: list[dict[str, Any]], rounds: int
) -> Path:
    """Left: each model at (round born, MACs) with an edge from its parent; right: final test accuracy vs MACs."""
    plt = pyplot()
    fig, (family, accuracy) = plt.subplots(1, 2, figsize=(10.0, 4.0), dpi=120)
    by_id = {m["id"]: m for m in models}
    for model in models:
        born = 0 if model["born_round"] is None else model["born_round"]
        if model["parent"] is not None:
            parent = by_id[model["parent"]]
            parent_born = 0 if parent["born_round"] is None else parent["born_round"]
            family.plot([parent_born, born], [parent["macs"] / 1e6, model["macs"] / 1e6], color="0.6", lw=1)
        family.scatter([born], [model["macs"] / 1e6], s=30, zorder=3)
        family.annotate(
            model["id"], (born, model["macs"] / 1e6), textcoords="offset points", xytext=(4, 4), fontsize=8
        )
    family.set_xlim(-0.5, max(rounds, 1) + 0.5)
    family.set_xlabel("round born (the seed model: 0)")
    family.set_ylabel("forward MACs per sample (M)")
    family.set_title("model family")
    family.grid(alpha=0.3)
    scores = [
        (by_id[e["name"]]["macs"] / 1e6, 100 * e["accuracy"], e["name"])
        for e in evaluated
        if e["name"] in by_id
    ]
    for macs, acc, name in scores:
        accuracy.scatter([macs], [acc], s=30)
        accuracy.annotate(name, (macs, acc), textcoords="offset points", xytext=(4, 4), fontsize=8)
    accuracy.set_xlabel("forward MACs per sample (M)")
    accuracy.set_ylabel("final test accuracy (%)")
    accuracy.set_title("accuracy by model")
    accuracy.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "growth.png"
    fig.savefig(path)
    plt.close(fig)
    return path
