"""FedTrans vs HeteroFL on CIFAR-10 (issue 13, METHODS §4.c small-scale target).

100 clients in six equal capacity tiers by client index (1, 2, 4, 8, 16, 32 × the seed model's MACs: a 32×
spread), 10 per round, the same rounds, seeds, data split, client draws and local recipe (20 SGD steps, batch
10, lr 0.05, METHODS §4.c) for both methods. FedTrans starts from the run's model and grows it; HeteroFL then
trains FedTrans's final largest model of the same seed as its full model, each tier at the widest HeteroFL
rate (1 … 1/16) whose MACs fit the tier's capacity, exactly the T_c FedTrans used.

Accuracy is METHODS §4.a.6's: every client is scored on its model (FedTrans: its highest-utility compatible
model; HeteroFL: its tier's width) on the common test set, and the mean over clients is reported (plus IQR).
Client MACs are counted the same way for both from every delivered result: forward MACs of the task's model ×
3 (forward + backward) × samples trained. The update direction screen is off for both (it cannot compare a
grown model's updates with the seed model's) and the quorum is 0.5. DoC's γ and δ are scaled down to the round budget (the paper's
γ = 10, δ = 20 need 30 rounds of the newest model before any growth); they are printed with the results.

Last line: `fedtrans_acc=<mean over seeds, %> heterofl_acc=<%> mac_ratio=<FedTrans MACs / HeteroFL MACs>`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from nestling.messages import Result, Task

TIERS = [1, 2, 4, 8, 16, 32]
HETEROFL_RATES = {"a": 1.0, "b": 0.5, "c": 0.25, "d": 0.125, "e": 0.0625}


class MacMeter:
    """Counts training MACs of every delivered result (a read-only result observer of the simulator)."""

    def __init__(self, input_shape: tuple[int, int, int]) -> None:
        from nestling.profiler.speed import MacCounter

        self.macs = MacCounter(input_shape)
        self.total = 0.0

    def __call__(self, task: Task, result: Result) -> None:
        from nestling.profiler.speed import TRAIN_OVER_FORWARD, samples_trained
        from nestling.spec import SubmodelSpec

        forward = self.macs(SubmodelSpec.from_dict(task.spec))
        self.total += forward * TRAIN_OVER_FORWARD * samples_trained(task.hparams, result.num_samples)


def base_config(a: argparse.Namespace, seed: int, method: dict[str, Any], extra: dict[str, Any]) -> Any:
    from nestling.config import config_from_dict

    return config_from_dict(
        {
            "run": {
                "rounds": a.rounds,
                "seed": seed,
                "workers": 1,
                "eval_every": a.rounds,
                "checkpoint_every": 0,
                # The direction screen can only compare updates that nest in the seed model's layout: it would
                # judge FedTrans's m0 boards and every HeteroFL board but no grown model's. Off for both, so the
                # methods are compared as their papers ran them; a refused result never voids a round.
                "min_update_cosine": -1.0,
                "quorum": 0.5,
            },
            "data": {
                "dataset": a.dataset,
                "root": a.data_root,
                "clients": a.clients,
                "partition": "iid",
                "limit_train": a.limit_train,
                "limit_test": a.limit_test,
            },
            "model": {"arch": a.model, "extra": extra},
            "method": method,
            "train": {
                "fraction": a.per_round / a.clients,
                "local_steps": a.local_steps,
                "batch_size": 10,
                "lr": 0.05,
                "momentum": 0.0,
                "schedule": "constant",
            },
        }
    )


def tier_of(client: int, clients: int) -> int:
    """Equal contiguous tiers by client index, as FedTrans's `capacities` option assigns them."""
    return min(int(client // max(1.0, clients / len(TIERS))), len(TIERS) - 1)


def spread(values: list[float]) -> tuple[float, float]:
    """Mean and interquartile range."""
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return statistics.fmean(values), quartiles[2] - quartiles[0]


def final_accuracy(out: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    return {s["name"]: s["accuracy"] for s in records[-1]["submodels"]}


def run_fedtrans(a: argparse.Namespace, seed: int, work: Path) -> dict[str, Any]:
    from nestling.simulator.run import run_simulation

    method = {
        "name": "fedtrans",
        "capacities": TIERS,
        "gamma": a.gamma,
        "delta": a.delta,
        "beta": a.beta,
    }
    meter = MacMeter((3, 32, 32) if a.dataset.startswith("cifar") else (1, 16, 16))
    summary = run_simulation(
        base_config(a, seed, method, {}), work / f"fedtrans-{seed}", observers=[meter], overwrite=True
    )
    report = summary["method_report"]["fedtrans"]
    accuracy = final_accuracy(work / f"fedtrans-{seed}")
    per_client = [accuracy[model] for model in report["deployed"].values()]
    mean, iqr = spread(per_client)
    largest = report["models"][-1]
    return {
        "acc": mean,
        "iqr": iqr,
        "macs": meter.total,
        "own_macs": report["client_macs_total"],
        "models": [
            (m["id"], m["parent"], m["born_round"], m["macs"], accuracy[m["id"]]) for m in report["models"]
        ],
        "deployed": dict(sorted(Counter(report["deployed"].values()).items())),
        "largest_layout": {"stage_blocks": largest["stage_blocks"], "block_hidden": largest["block_hidden"]},
        "seed_macs": report["models"][0]["macs"],
    }


def heterofl_mix(a: argparse.Namespace, layout: dict[str, Any], seed_macs: float) -> tuple[str, list[float]]:
    """One rate per tier: the widest HeteroFL rate whose MACs fit the tier's capacity (the narrowest if none)."""
    from nestling.models.config import ModelConfig
    from nestling.models.cost import count_macs
    from nestling.models.zoo import build
    from nestling.spec import SubmodelSpec

    shape = (3, 32, 32) if a.dataset.startswith("cifar") else (1, 16, 16)
    model = ModelConfig(
        a.model,
        10,
        shape[0],
        shape[1],
        norm_stats="batch",
        scaler="train",
        learnable_step=False,
        extra={"layout": layout},
    )
    cost = {
        letter: count_macs(build(SubmodelSpec(model, width=rate), init=False), shape)
        for letter, rate in HETEROFL_RATES.items()
    }
    letters = []
    for tier in TIERS:
        fitting = [letter for letter in HETEROFL_RATES if cost[letter] <= tier * seed_macs]
        letters.append(fitting[0] if fitting else "e")
    return "-".join(f"{letter}1" for letter in letters), [HETEROFL_RATES[letter] for letter in letters]


def run_heterofl(a: argparse.Namespace, seed: int, work: Path, fedtrans: dict[str, Any]) -> dict[str, Any]:
    from nestling.simulator.run import run_simulation

    mix, rates = heterofl_mix(a, fedtrans["largest_layout"], fedtrans["seed_macs"])
    meter = MacMeter((3, 32, 32) if a.dataset.startswith("cifar") else (1, 16, 16))
    extra = {"layout": fedtrans["largest_layout"]}
    run_simulation(
        base_config(a, seed, {"name": "heterofl", "mix": mix}, extra),
        work / f"heterofl-{seed}",
        observers=[meter],
        overwrite=True,
    )
    accuracy = final_accuracy(work / f"heterofl-{seed}")
    per_client = [accuracy[f"r{rates[tier_of(c, a.clients)]:g}"] for c in range(a.clients)]
    mean, iqr = spread(per_client)
    return {"acc": mean, "iqr": iqr, "macs": meter.total, "mix": mix, "accuracy": accuracy}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--model", default="tinycnn")
    parser.add_argument("--local-steps", type=int, default=20)
    parser.add_argument("--gamma", type=int, default=2)
    parser.add_argument("--delta", type=int, default=3)
    parser.add_argument("--beta", type=float, default=0.003)
    parser.add_argument("--limit-train", type=int, default=20000)
    parser.add_argument("--limit-test", type=int, default=2000)
    parser.add_argument("--dataset", default="cifar10")
    parser.add_argument(
        "--data-root",
        default=os.environ.get(
            "NESTLING_DATA_ROOT", str(Path(__file__).resolve().parents[2] / "shared" / "data")
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="digits, 12 clients, 6 rounds, one seed: a smoke check, not a measurement",
    )
    a = parser.parse_args(argv)
    if a.quick:
        a.rounds, a.seeds, a.clients, a.per_round = 6, [0], 12, 4
        a.dataset, a.local_steps, a.limit_train, a.limit_test = "digits", 5, 600, 200
        a.gamma, a.delta, a.beta = 1, 1, 10.0
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in a.seeds:
            fedtrans = run_fedtrans(a, seed, Path(tmp))
            heterofl = run_heterofl(a, seed, Path(tmp), fedtrans)
            rows.append((seed, fedtrans, heterofl))
            print(
                f"seed {seed}: FedTrans {100 * fedtrans['acc']:.2f}% (IQR {100 * fedtrans['iqr']:.2f}) "
                f"{fedtrans['macs'] / 1e12:.4f} TMACs; HeteroFL {100 * heterofl['acc']:.2f}% "
                f"(IQR {100 * heterofl['iqr']:.2f}) {heterofl['macs'] / 1e12:.4f} TMACs, mix {heterofl['mix']}"
            )
            print(f"  family (id, parent, born, MACs, accuracy): {fedtrans['models']}")
            print(
                f"  FedTrans deployments: {fedtrans['deployed']}; HeteroFL accuracy per rate: {heterofl['accuracy']}"
            )
            print(
                f"  FedTrans's own MAC count {fedtrans['own_macs'] / 1e12:.4f} TMACs (aggregated results only)"
            )
    fedtrans_acc = statistics.fmean(f["acc"] for _, f, _ in rows)
    heterofl_acc = statistics.fmean(h["acc"] for _, _, h in rows)
    ratio = sum(f["macs"] for _, f, _ in rows) / max(sum(h["macs"] for _, _, h in rows), 1.0)
    print(
        f"{a.dataset}, {a.model}, {a.clients} clients ({a.per_round}/round), {a.rounds} rounds, seeds {a.seeds}, "
        f"tiers {TIERS}x seed MACs, gamma {a.gamma} delta {a.delta} beta {a.beta}; "
        f"wall {time.perf_counter() - started:.0f}s"
    )
    print(
        f"fedtrans_acc={100 * fedtrans_acc:.2f} heterofl_acc={100 * heterofl_acc:.2f} mac_ratio={ratio:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
