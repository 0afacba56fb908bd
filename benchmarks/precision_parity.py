"""Is bf16 training safe for each method? fp32 and bf16 runs of FedAvg and the distillation methods, side by side.

`[train] precision = "bf16"` is a speed setting (edge/execution.py): the forward pass runs under autocast,
weights, optimiser state and uploads stay float32. It is only worth its speed if a federated run ends where
the fp32 run ends, and the methods that distil (DepthFL's mutual distillation between exits, ScaleFL's exit
self-distillation, m-FeDepth's mutual distillation between models, FjORD's p_max self-distillation) compare
softmaxes of nearly equal logits, which bf16's 8-bit mantissa may blur. This benchmark trains every method
twice from the same seed, partition, client draws and initial model — once in fp32, once in bf16 — and
compares the final test accuracy (mean over the method's evaluated submodels), any non-finite training loss,
rolled-back round or refused update, and the local-training time.

Distillation is switched on where a method's default leaves it off or weak, so a bf16 problem in it would
show: DepthFL ramps its KD weight to 1 over the run's rounds (default: over 300), ScaleFL distils with
γ = 1 (default 0: no distillation), FjORD distils from p_max (default off). m-FeDepth runs its defaults.
DepthFL runs without FedDyn (α = 0; default 0.1): FedDyn's terms are elementwise float32 arithmetic on the
weights, which autocast leaves alone, and with α = 0.1 DepthFL did not learn in the short runs this benchmark
affords (docs/benchmarks.md).

Safety rule, per method: bf16 is safe when no bf16 run had a non-finite training loss or a rolled-back round,
no bf16 run had more updates refused as non-finite, outsized or invalid than its fp32 twin, and the mean
accuracy drop (fp32 − bf16, points) is at most `--tolerance` (1 point) or the fp32 seed-to-seed range,
whichever is larger (a drop inside the noise of fp32 itself is not evidence against bf16). `--quick` is a
smoke check of the machinery: its verdict is not a recommendation.

Ends with `acc_drop_fedavg=… acc_drop_depthfl=… … time_ratio_fedavg=… … bf16_safe=fedavg,…` (time ratio =
bf16 training seconds ÷ fp32 training seconds; above 1 on CPUs without bf16 matrix units).
Run (full: CIFAR-10 ResNet-20; hours on 2 cores):
  OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.precision_parity --out runs/bench-precision
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Benchmark name -> (strategy name, options that switch its distillation on; "{rounds}" is the run's rounds).
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "fedavg": ("fedavg", {}),
    "depthfl": ("depthfl", {"kd_ramp_rounds": "{rounds}", "feddyn_alpha": 0.0}),
    "scalefl": ("scalefl", {"kd_gamma": 1.0}),
    "mfedepth": ("m-fedepth", {}),
    "fjord": ("fjord", {"kd": True}),
}
# What the bf16 run changes. `--fast-path` adds vs_flower's `nestling-bf16` engine settings (issue 6's workload).
PRECISIONS: dict[str, dict[str, Any]] = {"fp32": {}, "bf16": {"precision": "bf16"}}
FAST_PATH: dict[str, dict[str, Any]] = {"train": {"channels_last": True}, "run": {"batching": "auto"}}
# --quick checks the machinery in a few minutes of two busy cores, not the numerics: four digits clients (all
# sampled, so m-FeDepth's surplus client distils every round), two rounds, models near chance.
QUICK: dict[str, Any] = {
    "dataset": "digits",
    "clients": 4,
    "fraction": 1.0,
    "rounds": 2,
    "local_epochs": 1,
    "lr": 0.05,
    "limit_train": 400,
    "limit_test": 300,
    "seeds": "0",
    "workers": 1,
}


@dataclass
class Outcome:
    """What one run left: final accuracy (%), local training seconds, and its signs of trouble."""

    accuracy: float
    train_seconds: float
    non_finite_losses: int
    rolled_back: int
    refused: int


@dataclass
class MethodFigures:
    """fp32 and bf16 outcomes of one method over the seeds, and the verdict of the safety rule."""

    fp32: list[Outcome] = field(default_factory=list)
    bf16: list[Outcome] = field(default_factory=list)

    @property
    def drop(self) -> float:
        """Mean over seeds of fp32 − bf16 accuracy, in points (positive: bf16 is worse)."""
        return statistics.fmean(f.accuracy - b.accuracy for f, b in zip(self.fp32, self.bf16))

    @property
    def fp32_range(self) -> float:
        accuracies = [f.accuracy for f in self.fp32]
        return max(accuracies) - min(accuracies)

    @property
    def time_ratio(self) -> float:
        return sum(b.train_seconds for b in self.bf16) / max(sum(f.train_seconds for f in self.fp32), 1e-9)

    def trouble(self) -> list[str]:
        """Why bf16 misbehaved apart from accuracy: non-finite losses, rollbacks, extra refusals (numeric ones)."""
        found = []
        if any(b.non_finite_losses for b in self.bf16):
            found.append("non-finite training loss")
        if any(b.rolled_back for b in self.bf16):
            found.append("rolled-back round")
        if any(b.refused > f.refused for f, b in zip(self.fp32, self.bf16)):
            found.append("more updates refused than fp32")
        return found

    def allowed_drop(self, tolerance: float) -> float:
        return max(tolerance, self.fp32_range)

    def safe(self, tolerance: float) -> bool:
        return not self.trouble() and self.drop <= self.allowed_drop(tolerance)


def method_table(name: str, rounds: int) -> dict[str, Any]:
    """[method] for a benchmark method name, its distillation switched on."""
    if name not in METHODS:
        raise SystemExit(f"unknown method {name!r} (known: {', '.join(METHODS)})")
    strategy, options = METHODS[name]
    resolved = {k: (rounds if v == "{rounds}" else v) for k, v in options.items()}
    return {"name": strategy, **resolved}


def config(a: argparse.Namespace, method: str, precision: str, seed: int) -> Any:
    """One run: the shared workload, one method, one precision. Only the precision (and, with --fast-path, the
    bf16 engine's layout and batching) differs between the two runs of a method at a seed."""
    from nestling.config import config_from_dict

    run: dict[str, Any] = {
        "rounds": a.rounds,
        "seed": seed,
        "eval_every": a.rounds,
        "checkpoint_every": a.rounds,
        "workers": a.workers,
    }
    train: dict[str, Any] = {
        "fraction": a.fraction,
        "local_epochs": a.local_epochs,
        "batch_size": a.batch,
        "lr": a.lr,
        "momentum": a.momentum,
        "schedule": "step",
        "channels_last": a.channels_last,
        **PRECISIONS[precision],
    }
    if precision == "bf16" and a.fast_path:
        train.update(FAST_PATH["train"])
        run.update(FAST_PATH["run"])
    return config_from_dict(
        {
            "run": run,
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
            "method": method_table(method, a.rounds),
            "train": train,
        }
    )


def run_or_reuse(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """Run `cfg` into `run_dir`, or read the summary a finished run of the very same config left there."""
    from nestling.simulator.run import run_simulation

    summary_file = run_dir / "summary.json"
    if summary_file.is_file():
        summary: dict[str, Any] = json.loads(summary_file.read_text())
        if _what_it_computes(summary.get("config")) == _what_it_computes(
            json.loads(json.dumps(cfg.to_dict()))
        ):
            return summary
    return run_simulation(cfg, run_dir, overwrite=True)


def _what_it_computes(config: Any) -> Any:
    """A run's config without its worker count: every backend and worker count train the same weights
    (tests/simulator), so a finished run is reused whatever number of workers ran it."""
    if not isinstance(config, dict) or not isinstance(config.get("run"), dict):
        return config
    return {**config, "run": {k: v for k, v in config["run"].items() if k != "workers"}}


def outcome(summary: dict[str, Any], run_dir: Path) -> Outcome:
    """Accuracy and trouble signs of a finished run, from its summary and metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    losses = [r.get("train_loss") for r in records]
    final = [s["loss"] for s in summary.get("submodels", [])]
    non_finite = sum(1 for v in [*losses, *final] if v is not None and not math.isfinite(float(v)))
    accuracy = summary.get("avg_accuracy")
    if accuracy is None or not math.isfinite(float(accuracy)):
        non_finite += 1
        accuracy = 0.0
    # Refusals that would show broken numerics (non-finite or outsized updates, invalid results); not the
    # direction screen's, which refuses honest non-IID updates too (docs/benchmarks.md, robustness).
    refused = sum(
        v
        for r in records
        for k, v in (r.get("counters") or {}).items()
        if k.startswith("rejected_") and k != "rejected_update_direction"
    )
    return Outcome(
        accuracy=100 * float(accuracy),
        train_seconds=float(summary["train_seconds"]),
        non_finite_losses=non_finite,
        rolled_back=sum(1 for r in records if r.get("rolled_back") is not None),
        refused=int(refused),
    )


def verdict_line(figures: dict[str, MethodFigures], tolerance: float) -> str:
    drops = " ".join(f"acc_drop_{m}={f.drop:.2f}" for m, f in figures.items())
    ratios = " ".join(f"time_ratio_{m}={f.time_ratio:.2f}" for m, f in figures.items())
    safe = [m for m, f in figures.items() if f.safe(tolerance)]
    return f"{drops} {ratios} bf16_safe={','.join(safe) or 'none'}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}"
    )
    parser.add_argument("--dataset", default="cifar10")
    parser.add_argument("--data-root", default=None, help="default: $NESTLING_DATA_ROOT or ../shared/data")
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew")
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1, help="SGD, x0.1 at 50 %% and 75 %% of the rounds")
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument(
        "--channels-last",
        action="store_true",
        help="NHWC for both precisions (bf16 convolutions on CPUs without bf16 matrix units run faster so)",
    )
    parser.add_argument("--limit-train", type=int, default=None)
    parser.add_argument("--limit-test", type=int, default=None)
    parser.add_argument("--seeds", default="0,1", help="comma-separated run seeds")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=1.0, help="accuracy drop (points) still safe")
    parser.add_argument(
        "--fast-path",
        action="store_true",
        help="bf16 runs also use channels-last and batching auto (vs_flower's nestling-bf16 engine)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="keep the runs here and reuse finished ones (default: temporary)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="digits, ResNet-20, 4 clients, 2 rounds, one seed: a smoke check (minutes); other options still apply",
    )
    if "--quick" in (argv if argv is not None else sys.argv[1:]):
        parser.set_defaults(**QUICK)  # options given on the command line still win
    a = parser.parse_args(argv)
    if a.data_root is None and a.dataset.startswith("cifar"):
        from nestling.simulator.reproduce_cli import default_data_root

        a.data_root = default_data_root()
    return a


def main(argv: list[str] | None = None) -> int:
    import tempfile

    import torch

    a = parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    for name in methods:
        method_table(name, a.rounds)  # an unknown name stops here, before any run
    seeds = [int(s) for s in a.seeds.split(",")]
    torch.set_num_threads(1)
    started = time.perf_counter()
    figures = {m: MethodFigures() for m in methods}
    with tempfile.TemporaryDirectory() as tmp:
        work = a.out if a.out is not None else Path(tmp)
        for seed in seeds:
            for method in methods:
                for precision in PRECISIONS:
                    run_dir = work / f"seed-{seed}" / method / precision
                    summary = run_or_reuse(config(a, method, precision, seed), run_dir)
                    result = outcome(summary, run_dir)
                    getattr(figures[method], precision).append(result)
                    print(
                        f"seed {seed} {method:9s} {precision}: {result.accuracy:6.2f}%  training "
                        f"{result.train_seconds:7.1f} s  non-finite {result.non_finite_losses}  "
                        f"rolled back {result.rolled_back}  refused {result.refused}",
                        flush=True,
                    )
        if a.out is not None:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "figures.json").write_text(
                json.dumps(
                    {
                        m: {"fp32": [vars(o) for o in f.fp32], "bf16": [vars(o) for o in f.bf16]}
                        for m, f in figures.items()
                    }
                )
            )
    print(
        f"\n{a.dataset} {a.model}, {a.clients} clients (Dirichlet {a.alpha}), {a.fraction:g} per round, "
        f"{a.rounds} rounds, seeds {a.seeds}{', bf16 with the fast path' if a.fast_path else ''}; "
        f"{time.perf_counter() - started:.0f} s in all"
    )
    print(
        f"rule: safe = no non-finite loss, rollback or extra refusal in bf16, and mean drop (fp32 - bf16) "
        f"<= max({a.tolerance:g} point, fp32 seed range)"
        + ("  [--quick: a smoke check, not a verdict]" if a.quick else "")
    )
    print(f"{'method':9s} {'fp32 %':>7s} {'bf16 %':>7s} {'drop':>6s} {'allowed':>7s} {'time x':>6s}  verdict")
    for method, f in figures.items():
        trouble = f.trouble()
        verdict = "safe" if f.safe(a.tolerance) else "NOT safe: " + (", ".join(trouble) or "accuracy drop")
        print(
            f"{method:9s} {statistics.fmean(o.accuracy for o in f.fp32):7.2f} "
            f"{statistics.fmean(o.accuracy for o in f.bf16):7.2f} {f.drop:6.2f} "
            f"{f.allowed_drop(a.tolerance):7.2f} {f.time_ratio:6.2f}  {verdict}"
        )
    print(verdict_line(figures, a.tolerance))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
