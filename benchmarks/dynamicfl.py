"""DynamicFL vs FedAvg on the same plain model (issue 14), and what an expansion costs per capacity class.

Every seed runs FedAvg and DynamicFL (paper protocol) with the same data, partition, rounds, schedule and
client draws; the boards' capacities are {0, 1, 2} in equal thirds by client index. Local training runs at least
two epochs (the released code's 2, the default): the modulation (DYMM, or the released code's growth) runs after
the first epoch, so with one epoch the structure a board reports was never trained (`--local-epochs 1` is
refused). Reported:

* `dynamicfl_acc`, `fedavg_acc`: test accuracy of the final global model, mean over seeds.
* `gain_by_capacity=g0/g1/g2`, in points, mean over seeds, one of two measures (`--gain-by`):
  `single-class` (default): two more runs per seed in which every board has capacity 1 (then 2), minus FedAvg
  (capacity 0 everywhere is FedAvg bit for bit, so g0 = 0): the capacity effect the paper claims grows with c;
  `label-mix` (no extra runs, diagnostic only): the mixed run's one final model weighted by the label mix of each
  capacity class's clients, DynamicFL minus FedAvg — that measures which labels each class holds, not capacity.
* `expanded_by_capacity=e0/e1/e2`: what was trained — per capacity class of the mixed run, the mean number of
  convs the boards' final-round structure expands (trained in epochs 2..E of that round), mean over seeds; the
  convs themselves are printed per class.
* extra training time and memory per capacity class: one training step of the model with c convs expanded
  (the paper's round-0 choice, bottom-up), timed side by side with the plain step (interleaved repetitions)
  and its autograd-saved bytes measured (profiler.memory.SavedTensorMeter), with the estimator's price
  (nestling.methods.dynamicfl.capacity_cost, the worst choice of c convs) beside it.

Last line: `dynamicfl_acc=… fedavg_acc=… gain_by_capacity=g0/g1/g2 gain_by=… local_epochs=E expanded_by_capacity=…
time_ratio_by_capacity=… saved_mb_by_capacity=…`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

CAPACITIES = [0, 1, 2]


def config(a: argparse.Namespace, method: str, seed: int, capacities: list[int] = CAPACITIES) -> Any:
    from nestling.config import config_from_dict

    method_table: dict[str, Any] = {"name": method}
    if method == "dynamicfl":
        method_table.update(capacities=capacities, protocol=a.protocol)
    return config_from_dict(
        {
            "run": {
                "rounds": a.rounds,
                "seed": seed,
                "eval_every": a.rounds,
                "checkpoint_every": a.rounds,
                "workers": a.workers,
            },
            "data": {
                "dataset": a.dataset,
                "root": a.data_root,
                "partition": "dirichlet",
                "alpha": a.alpha,
                "clients": a.clients,
                "limit_train": a.limit_train,
                "limit_test": a.limit_test,
            },
            "model": {"arch": a.model},
            "method": method_table,
            "train": {
                "fraction": a.fraction,
                "local_epochs": a.local_epochs,
                "batch_size": a.batch,
                "lr": a.lr,
                "momentum": a.momentum,
                "weight_decay": 5e-4,
                "schedule": "cosine",
            },
        }
    )


def run_or_reuse(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """Run `cfg` into `run_dir`, or read the summary a finished run with the same config left there (--out)."""
    from nestling.simulator.reproduce_cli import run_state
    from nestling.simulator.run import run_simulation

    if run_state(run_dir, cfg) == "done":
        return json.loads((run_dir / "summary.json").read_text())
    state = run_state(run_dir, cfg)  # "new" may hold this configuration's attempt from before a checkpoint
    return run_simulation(cfg, run_dir, resume=state == "partial", overwrite=state == "new")


def per_label_accuracy(run_dir: Path, data: Any) -> np.ndarray:
    """The final global model's accuracy on each label of the test set (from the run's self-describing checkpoint)."""
    from nestling.calibration import model_for_target
    from nestling.checkpoint_io import latest_checkpoint, load_deployables

    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    if checkpoint is None:
        raise SystemExit(f"{run_dir} wrote no checkpoint")
    deployables, _ = load_deployables(checkpoint)
    model = model_for_target(deployables.targets[-1])
    model.eval()
    test = data.bundle.test
    correct = np.zeros(data.bundle.num_classes)
    total = np.zeros(data.bundle.num_classes)
    with torch.no_grad():
        for start in range(0, len(test.y), 500):
            x, y = test.x[start : start + 500], test.y[start : start + 500]
            out = model(x)
            hit = (out[-1] if isinstance(out, list) else out).argmax(1) == y
            np.add.at(correct, y.numpy(), hit.numpy())
            np.add.at(total, y.numpy(), 1)
    return correct / np.maximum(total, 1)


def class_label_mix(data: Any, clients: int) -> list[np.ndarray]:
    """Each capacity class's label histogram (equal thirds by client index, as the strategy's tiers)."""
    labels = data.bundle.train.y.numpy()
    per_tier = max(1.0, clients / len(CAPACITIES))
    mixes = [np.zeros(data.bundle.num_classes) for _ in CAPACITIES]
    for index, part in enumerate(data.parts):
        tier = min(int(index // per_tier), len(CAPACITIES) - 1)
        np.add.at(mixes[tier], labels[part], 1)
    return [mix / max(mix.sum(), 1) for mix in mixes]


def trained_structures(summary: dict[str, Any]) -> dict[int, tuple[float, dict[str, int]]]:
    """Per capacity class of a DynamicFL run: mean convs expanded in the boards' final structure, and how many
    boards expanded each conv (what the boards trained after the round's modulation)."""
    from nestling.server.strategies.dynamicfl import expanded_by_class

    report = summary.get("method_report", {})
    classes = report.get("dynamicfl", {}).get("classes", {})
    return {
        int(label.removeprefix("c")): (mean, dict(classes[label].get("expanded_sites", {})))
        for label, (mean, _) in expanded_by_class(report).items()
    }


def step_costs(
    model_name: str, dataset_shape: tuple[int, int, int], classes: int, batch: int, repeats: int
) -> list[dict]:
    """Measured time ratio and saved bytes of a training step with c convs expanded, per capacity."""
    from nestling.methods.dynamicfl import bottom_up, capacity_cost, expand_model, find_sites
    from nestling.models.config import ModelConfig
    from nestling.models.zoo import build
    from nestling.profiler.memory import SavedTensorMeter, model_tensors
    from nestling.spec import SubmodelSpec

    channels, size, _ = dataset_shape
    spec = SubmodelSpec.full(
        ModelConfig(
            arch=model_name, num_classes=classes, in_channels=channels, image_size=size, learnable_step=False
        )
    )
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, channels, size, size, generator=generator)
    y = torch.randint(0, classes, (batch,), generator=generator)
    models = {}
    for capacity in CAPACITIES:
        torch.manual_seed(0)
        model = build(spec)
        sites = find_sites(model, (channels, size, size))
        expand_model(
            model, sites, dict.fromkeys(bottom_up(sites, capacity)), batches=[x], generator=generator
        )
        models[capacity] = (model, sites)

    def train_step(model: torch.nn.Module) -> None:
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out[-1] if isinstance(out, list) else out, y)
        model.zero_grad(set_to_none=True)
        loss.backward()

    seconds: dict[int, list[float]] = {c: [] for c in CAPACITIES}
    for model, _ in models.values():
        model.train()
        train_step(model)  # warm-up
    for _ in range(repeats):  # interleaved: a noisy machine slows every variant alike
        for capacity, (model, _) in models.items():
            started = time.perf_counter()
            train_step(model)
            seconds[capacity].append(time.perf_counter() - started)
    rows = []
    plain_time = statistics.median(seconds[0])
    for capacity, (model, sites) in models.items():
        with SavedTensorMeter(exclude=model_tensors(model)) as meter:
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out[-1] if isinstance(out, list) else out, y)
        loss.backward()
        priced = capacity_cost(sites, capacity, batch=batch) if capacity else None
        rows.append(
            {
                "capacity": capacity,
                "time_ratio": statistics.median(seconds[capacity]) / plain_time,
                "saved_bytes": meter.total_bytes,
                "params": sum(p.numel() for p in model.parameters()),
                "priced_extra_bytes": priced.training_bytes(batch) if priced else 0,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="cifar10")
    parser.add_argument("--data-root", default=None, help="default: $NESTLING_DATA_ROOT or ../shared/data")
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--clients", type=int, default=30)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--fraction", type=float, default=1 / 3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--limit-train", type=int, default=None)
    parser.add_argument("--limit-test", type=int, default=None)
    parser.add_argument("--protocol", default="paper", choices=("paper", "released"))
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20, help="timed training steps per capacity")
    parser.add_argument(
        "--out", default=None, help="keep the runs here and reuse finished ones (default: a temporary folder)"
    )
    parser.add_argument(
        "--gain-by",
        default="single-class",
        choices=("single-class", "label-mix"),
        help="single-class: extra runs in which every board has capacity c, minus FedAvg (c = 0 is FedAvg bit for "
        "bit); label-mix (diagnostic): the mixed run's one model on each capacity class's label mix",
    )
    parser.add_argument("--quick", action="store_true", help="digits, tinycnn, 3 rounds: a smoke check")
    a = parser.parse_args(argv)
    if a.quick:
        a.dataset, a.model, a.clients, a.rounds, a.local_epochs, a.batch = "digits", "tinycnn", 6, 3, 2, 16
        a.fraction, a.workers, a.repeats, a.seeds, a.limit_train = 1.0, 1, 3, "0", 360
    if a.local_epochs < 2:
        parser.error(
            f"--local-epochs {a.local_epochs}: DynamicFL modulates the structure after the first epoch, so with "
            "one epoch the structure reported is not the one trained; use 2 or more (the released code's 2)"
        )
    if a.data_root is None and a.dataset.startswith("cifar"):
        from nestling.simulator.reproduce_cli import default_data_root

        a.data_root = default_data_root()
    seeds = [int(s) for s in a.seeds.split(",")]
    torch.set_num_threads(1)
    from rich.progress import Progress

    from nestling.simulator.fleetdata import load_fleet_data
    from nestling.simulator.run import fleet_args

    started = time.perf_counter()
    accuracy: dict[str, list[float]] = {"fedavg": [], "dynamicfl": []}
    gains: list[list[float]] = []
    expanded: list[list[float]] = []
    with tempfile.TemporaryDirectory() as tmp, Progress(transient=True) as progress:
        work = Path(a.out) if a.out else Path(tmp)
        extra = [1, 2] if a.gain_by == "single-class" else []
        bar = progress.add_task("runs", total=(2 + len(extra)) * len(seeds))
        for seed in seeds:
            by_method: dict[str, np.ndarray] = {}
            data = None
            for method in ("fedavg", "dynamicfl"):
                progress.update(bar, description=f"seed {seed} {method}")
                cfg = config(a, method, seed)
                run_dir = work / f"seed-{seed}" / method
                summary = run_or_reuse(cfg, run_dir)
                accuracy[method].append(100 * summary["worst_accuracy"])
                data = data or load_fleet_data(**fleet_args(cfg))
                by_method[method] = per_label_accuracy(run_dir, data)
                progress.advance(bar)
                if method == "dynamicfl":
                    trained = trained_structures(summary)
                    expanded.append([trained.get(c, (0.0, {}))[0] for c in CAPACITIES])
                    for capacity in CAPACITIES:
                        mean, sites = trained.get(capacity, (0.0, {}))
                        print(
                            f"seed {seed}: capacity {capacity} boards trained {mean:.2f} expanded convs in the "
                            f"final round (boards per conv: {sites or 'none'})"
                        )
            assert data is not None
            mixes = class_label_mix(data, a.clients)
            label_mix = [100 * float(mix @ (by_method["dynamicfl"] - by_method["fedavg"])) for mix in mixes]
            print(
                f"seed {seed}: fedavg {accuracy['fedavg'][-1]:.2f}%  dynamicfl {accuracy['dynamicfl'][-1]:.2f}%  "
                f"gain on each capacity class's label mix " + " / ".join(f"{g:+.2f}" for g in label_mix)
            )
            if not extra:
                gains.append(label_mix)
                continue
            single = [
                0.0
            ]  # every board at capacity 0 is FedAvg bit for bit (tests/server/strategies/test_dynamicfl.py)
            for capacity in extra:
                progress.update(bar, description=f"seed {seed} dynamicfl, every board c={capacity}")
                cfg = config(a, "dynamicfl", seed, capacities=[capacity])
                summary = run_or_reuse(cfg, work / f"seed-{seed}" / f"dynamicfl-c{capacity}")
                single.append(100 * summary["worst_accuracy"] - accuracy["fedavg"][-1])
                progress.advance(bar)
            gains.append(single)
            print(
                f"seed {seed}: every board at capacity 0/1/2 minus FedAvg "
                + " / ".join(f"{g:+.2f}" for g in single)
            )
        shape = tuple(data.bundle.train.x.shape[1:]) if data is not None else (3, 32, 32)
        classes = data.bundle.num_classes if data is not None else 10
    costs = step_costs(a.model, shape, classes, a.batch, a.repeats)
    for row in costs:
        print(
            f"capacity {row['capacity']}: step time x{row['time_ratio']:.2f} of plain, saved activations "
            f"{row['saved_bytes'] / 2**20:.1f} MB, parameters {row['params']:,}, "
            f"priced extra (worst {row['capacity']} convs) {row['priced_extra_bytes'] / 2**20:.1f} MB"
        )

    def mean_std(values: list[float]) -> str:
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.mean(values):.2f} ± {spread:.2f}"

    print(
        f"{a.dataset} {a.model}, {a.clients} clients Dirichlet({a.alpha}), {a.rounds} rounds x {a.local_epochs} epochs, "
        f"fraction {a.fraction:.2f}, seeds {seeds}, protocol {a.protocol}; wall {time.perf_counter() - started:.0f}s; "
        f"fedavg {mean_std(accuracy['fedavg'])}, dynamicfl {mean_std(accuracy['dynamicfl'])}"
    )
    mean_gains = [statistics.mean(g[i] for g in gains) for i in range(len(CAPACITIES))]
    plain_saved = costs[0]["saved_bytes"]
    print(
        json.dumps({"accuracy": accuracy, "gains": gains, "costs": costs}, separators=(",", ":")),
        file=sys.stderr,
    )
    mean_expanded = [statistics.mean(e[i] for e in expanded) for i in range(len(CAPACITIES))]
    ratios = "/".join(f"{row['time_ratio']:.2f}" for row in costs)
    saved = "/".join(f"{(row['saved_bytes'] - plain_saved) / 2**20:+.1f}" for row in costs)
    print(
        f"dynamicfl_acc={statistics.mean(accuracy['dynamicfl']):.2f} fedavg_acc={statistics.mean(accuracy['fedavg']):.2f} "
        f"gain_by_capacity={'/'.join(f'{g:+.2f}' for g in mean_gains)} gain_by={a.gain_by} "
        f"local_epochs={a.local_epochs} expanded_by_capacity={'/'.join(f'{e:.2f}' for e in mean_expanded)} "
        f"time_ratio_by_capacity={ratios} saved_mb_by_capacity={saved}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
