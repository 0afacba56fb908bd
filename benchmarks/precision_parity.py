"""Does bf16 training reach the accuracy of fp32? FedAvg ResNet-20 on real CIFAR-10, same seeds, both ways.

`[train] precision = "bf16"` is a speed setting (edge/execution.py): the forward pass runs under autocast,
weights, optimiser state and uploads stay float32. It is only worth its speed if a federated run ends where
the fp32 run ends. This benchmark runs the workload of `benchmarks/vs_flower.py` on real data — ResNet-20,
100 clients (Dirichlet 0.5), 10 per round, 1 local epoch, batch 32, SGD lr 0.1 with step decay — once in
fp32 (NCHW, one client at a time: Flower's textbook numerics) and once as `nestling-bf16` trains it
(bf16 autocast, channels-last, batching auto), for each seed, and compares final test accuracy with the
seed-to-seed spread of fp32 itself.
Ends with `fp32_acc=… bf16_acc=… acc_gap=… fp32_seed_spread=… bf16_speedup=…` (accuracies in %, means
over seeds; acc_gap = bf16 − fp32; bf16_speedup = fp32 training seconds ÷ bf16 training seconds).
Run (in the background; ~25 min at 40 rounds and 2 seeds):
  OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.precision_parity --data-root ../shared/data
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from nestling.config import load_config
from nestling.simulator.run import run_simulation

PRECISIONS = {
    "fp32": {},
    "bf16": {"train.precision": "bf16", "train.channels_last": True, "run.batching": "auto"},
}


def overrides(args: argparse.Namespace, precision: str, seed: int) -> dict[str, Any]:
    """The shared workload plus one precision's execution settings."""
    return {
        "method.name": "fedavg",
        "model.arch": "resnet20",
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
        "run.rounds": args.rounds,
        "run.eval_every": 0,
        "run.checkpoint_every": 0,
        "run.seed": seed,
        **PRECISIONS[precision],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", required=True, help="folder with cifar10/ (train.npz, test.npz)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seeds", default="0,1", help="comma-separated run seeds")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-precision"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    accuracy: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    seconds: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for seed in seeds:
        for precision in PRECISIONS:
            started = time.perf_counter()
            summary = run_simulation(
                load_config(None, overrides(args, precision, seed)), args.out / f"{precision}-seed{seed}"
            )
            wall = time.perf_counter() - started
            accuracy[precision].append(100 * summary["avg_accuracy"])
            seconds[precision].append(summary["train_seconds"])
            print(
                f"seed {seed} {precision}: {accuracy[precision][-1]:.2f}% after {summary['rounds']} rounds, "
                f"training {summary['train_seconds']:.0f} s, wall {wall:.0f} s",
                flush=True,
            )
    figures = {
        "fp32_acc": statistics.fmean(accuracy["fp32"]),
        "bf16_acc": statistics.fmean(accuracy["bf16"]),
        "acc_gap": statistics.fmean(b - f for b, f in zip(accuracy["bf16"], accuracy["fp32"])),
        "fp32_seed_spread": max(accuracy["fp32"]) - min(accuracy["fp32"]),
        "bf16_speedup": sum(seconds["fp32"]) / sum(seconds["bf16"]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "figures.json").write_text(json.dumps({"accuracy": accuracy, "seconds": seconds, **figures}))
    print(" ".join(f"{k}={v:.3f}" if k == "bf16_speedup" else f"{k}={v:.2f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
