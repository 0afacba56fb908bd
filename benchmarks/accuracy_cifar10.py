"""Worst/avg submodel accuracy of several methods on CIFAR-10 within a fixed time budget each.

ResNet-20, 100 clients, 10 per round, Dirichlet(0.5), NeFL's local recipe (SGD lr 0.1, no momentum, batch 32,
×0.1 at 50% and 75% of the rounds) with 1 local epoch. Each method first times one round, then runs as many
rounds as fit in its budget; the full 10,000-image test set is evaluated at the end.
Run (in the background; ~25 min per method):
  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/accuracy_cifar10.py --data-root ../shared/data --minutes 25
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from nestling.config import load_config
from nestling.server.strategies.nefl_presets import PARAM_FRACTIONS
from nestling.simulator.run import run_simulation
from nestling.spec import width_from_param_fraction
from nestling.strict_json import strict_dumps

DEFAULT_METHODS = ("nefl-wd", "fjord", "heterofl")


def config_for(method: str, args: argparse.Namespace, rounds: int, model: str) -> dict:
    overrides = {
        "method.name": method,
        "model.arch": model,
        "data.dataset": "cifar10",
        "data.root": args.data_root,
        "data.partition": "dirichlet",
        "data.alpha": 0.5,
        "data.clients": 100,
        "train.fraction": 0.1,
        "train.local_epochs": 1,
        "train.batch_size": 32,
        "train.lr": 0.1,
        "train.schedule": "step",
        "run.rounds": rounds,
        "run.eval_every": 0,
        "run.checkpoint_every": 0,
        "run.seed": args.seed,
    }
    if method in ("fedepth", "m-fedepth"):
        overrides["method.budgets"] = "fair"
    # NeFL's comparison: every method at the same five submodel sizes γ = 0.2 … 1 (channel ratio √γ), not
    # HeteroFL's and FjORD's own defaults (docs/methods-decisions.md).
    if method == "heterofl":
        overrides["method.rates"] = [width_from_param_fraction(g) for g in PARAM_FRACTIONS]
    if method == "fjord":
        overrides["method.widths"] = [round(width_from_param_fraction(g), 6) for g in PARAM_FRACTIONS]
    return overrides


def run_method(method: str, args: argparse.Namespace, out_root: Path) -> dict:
    model = "preresnet20" if method in ("fedepth", "m-fedepth") or args.preresnet else args.model
    if args.rounds:  # equal rounds for every method: the fair comparison when round costs differ
        started = time.perf_counter()
        summary = run_simulation(
            load_config(None, config_for(method, args, args.rounds, model)), out_root / method, overwrite=True
        )
        summary["bench_minutes"] = (time.perf_counter() - started) / 60
        return summary
    probe = run_simulation(
        load_config(None, {**config_for(method, args, 1, model), "data.limit_test": 500}),
        out_root / f"{method}-probe",
        overwrite=True,
    )
    per_round = probe["train_seconds"] + 1.0
    rounds = max(2, int(args.minutes * 60 / per_round))
    print(f"{method}: one round took {per_round:.1f}s → {rounds} rounds in {args.minutes} min", flush=True)
    started = time.perf_counter()
    summary = run_simulation(
        load_config(None, config_for(method, args, rounds, model)), out_root / method, overwrite=True
    )
    summary["bench_minutes"] = (time.perf_counter() - started) / 60
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", required=True, help="folder with cifar10/ (train.npz, test.npz)")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--preresnet", action="store_true", help="use PreResNet-20 for every method")
    parser.add_argument("--minutes", type=float, default=25.0)
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="run exactly this many rounds per method instead of a time budget",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-cifar10"))
    args = parser.parse_args()
    figures: dict[str, float] = {}
    for method in args.methods.split(","):
        summary = run_method(method, args, args.out)
        figures[f"{method}_worst"] = summary["worst_accuracy"]
        figures[f"{method}_avg"] = summary["avg_accuracy"]
        table = ", ".join(f"{s['name']} {100 * s['accuracy']:.2f}%" for s in summary["submodels"])
        print(
            f"{method}: {summary['rounds']} rounds, {summary['bench_minutes']:.1f} min; {table}", flush=True
        )
        (args.out / "figures.json").write_text(strict_dumps(figures, indent=1))
    print(" ".join(f"{k}={100 * v:.2f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
