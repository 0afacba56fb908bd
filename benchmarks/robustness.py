"""Robustness: one bad board among 10 against an honest run (issue 16).

Digits, 10 boards, every board every round, the same seed and rounds for every run. Each attack run
has board 0 send, every round instead of its trained result: huge finite values (3.0e38), its update
scaled x100, its update sign-flipped, or all-zero weights claiming 10**9 samples. Two honest runs,
with screening (the default) and without (screen_updates and divergence_guard off), time the
coordinator's screening + aggregation side by side. The simulator's in-process transport carries
the results: screening lives in the coordinator, which every transport (MQTT included) goes through.

Last line: `worst_acc_drop=<points> runs_finished=K/N honest_overhead=<with/without>`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from nestling.messages import Result, Task

Tamper = Callable[[Task, Result], Result]
ATTACKER = "dev-00000"


def _update(
    task: Task, result: Result, transform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> Result:
    if result.device_id != ATTACKER:
        return result
    weights = {
        k: transform(task.weights[k], v) if v.is_floating_point() and k in task.weights else v
        for k, v in result.weights.items()
    }
    return replace(result, weights=weights)


def huge(task: Task, result: Result) -> Result:
    return _update(task, result, lambda base, trained: torch.full_like(trained, 3.0e38))


def scaled(task: Task, result: Result) -> Result:
    return _update(task, result, lambda base, trained: base + 100.0 * (trained - base))


def sign_flipped(task: Task, result: Result) -> Result:
    return _update(task, result, lambda base, trained: base - (trained - base))


def inflated(task: Task, result: Result) -> Result:
    if result.device_id != ATTACKER:
        return result
    zeroed = _update(task, result, lambda base, trained: torch.zeros_like(trained))
    return replace(zeroed, num_samples=10**9)


def inflated_bn_variance(task: Task, result: Result) -> Result:
    """Honest weights; every BN running variance × 10^4 (finite): wrecks every model evaluated with them."""
    if result.device_id != ATTACKER:
        return result
    weights = {
        k: v * 1.0e4 if k.rsplit(".", 1)[-1] == "running_var" else v for k, v in result.weights.items()
    }
    return replace(result, weights=weights)


ATTACKS: dict[str, Tamper] = {
    "huge_values": huge,
    "scaled_x100": scaled,
    "sign_flipped": sign_flipped,
    "inflated_num_samples": inflated,
    "inflated_bn_variance": inflated_bn_variance,
}


def config(a: argparse.Namespace, screening: bool) -> Any:
    from nestling.config import config_from_dict

    return config_from_dict(
        {
            "run": {
                "rounds": a.rounds,
                "seed": a.seed,
                "quorum": 0.6,
                "eval_every": a.rounds,
                "checkpoint_every": 0,
                "workers": 1,
                "screen_updates": screening,
                "divergence_guard": screening,
                "aggregation": a.aggregation,
                **({} if a.min_update_cosine is None else {"min_update_cosine": a.min_update_cosine}),
            },
            "data": {"dataset": "digits", "clients": 10},
            "model": {"arch": a.model},
            "method": {"name": a.method},
            "train": {
                "fraction": 1.0,
                "local_epochs": a.local_epochs,
                "batch_size": 32,
                "lr": 0.05,
                "momentum": 0.9,
                "schedule": "constant",
            },
        }
    )


def one_run(
    a: argparse.Namespace, work: Path, name: str, tamper: Tamper | None, screening: bool = True
) -> dict:
    from nestling.simulator.run import run_simulation

    summary = run_simulation(config(a, screening), work / name, tamper=tamper, overwrite=True)
    metrics = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines() if line]
    return {
        "name": name,
        "accuracy": summary["worst_accuracy"],
        "finished": len(metrics) == a.rounds,
        "aggregate_seconds": summary["aggregate_seconds"],
        "quarantined": summary["quarantined"],
        "refused": sum(
            sum(v for k, v in m["counters"].items() if k.startswith("rejected_")) for m in metrics
        ),
    }


class Recorder:
    """A tamper that changes nothing and keeps the last round's (task, result) pairs, for the timing below."""

    def __init__(self) -> None:
        self.rounds: dict[int, list[tuple[Task, Result]]] = {}

    def __call__(self, task: Task, result: Result) -> Result:
        self.rounds.setdefault(task.round, []).append((task, result))
        return result


def interleaved_overhead(
    method: str, pairs: list[tuple[Task, Result]], repeats: int
) -> tuple[float, float, float]:
    """Median seconds of (screening + guard + aggregation) and of aggregation alone on one recorded honest round,
    timed alternately `repeats` times on fresh strategies (a noisy machine slows both alike); and their ratio."""
    from statistics import median

    from nestling.server.running_statistics import measure as measure_statistics
    from nestling.server.running_statistics import statistics_outliers
    from nestling.server.screening import (
        GlobalLayout,
        RobustPolicy,
        UpdateWorkspace,
        direction_cosines,
        direction_outliers,
        largest_magnitude,
        screen_norms,
    )
    from nestling.server.strategies import StrategyContext, create_strategy
    from nestling.spec import SubmodelSpec

    model = SubmodelSpec.from_dict(pairs[0][0].spec).model
    ctx = StrategyContext(
        arch=model.arch,
        num_classes=model.num_classes,
        in_channels=model.in_channels,
        image_size=model.image_size,
        num_clients=len(pairs),
        total_rounds=1,
        model_extra=dict(model.extra),
    )
    policy = RobustPolicy()
    round_index = pairs[0][0].round
    first = create_strategy(method, ctx)
    # The coordinator keeps the global layout (positions cached per submodel layout), its update buffers and
    # the global model's largest |w| (measured after the previous round's aggregation) between rounds.
    layout = GlobalLayout({k: tuple(v.shape) for k, v in first.global_state.items() if v.is_floating_point()})
    workspace = UpdateWorkspace()
    scale_before = largest_magnitude(first.global_state)
    recent = 0.01  # the look back on earlier rounds' median update (a number the coordinator keeps)

    # Both runs replay the round as the coordinator receives it: each result is validated on arrival
    # (names, shapes, dtypes, finiteness; in both modes and outside the measured time), and with screening the
    # update of a result that is not packed (nestling/packed.py) is measured right after; packed results' updates
    # are measured together at the round's end, then the round's screens, the guard and the aggregation follow.
    def aggregate_only() -> float:
        strategy = create_strategy(method, ctx)
        for task, result in pairs:
            strategy.validate(task, result)
        started = time.perf_counter()
        strategy.aggregate(round_index, pairs)
        return time.perf_counter() - started

    def screened() -> float:
        strategy = create_strategy(method, ctx)
        workspace.new_round(len(pairs))
        spent, on_arrival = 0.0, {}
        for task, result in pairs:
            strategy.validate(task, result)
            started = time.perf_counter()
            if not workspace.packed(task, result):  # packed results are measured with the round, below
                on_arrival[result.task_id] = workspace.flat_update(task, result)
            spent += time.perf_counter() - started
        started = time.perf_counter()
        waiting = [(task, result) for task, result in pairs if result.task_id not in on_arrival]
        measured = dict(zip([r.task_id for _, r in waiting], workspace.flat_updates(waiting), strict=True))
        updates = [on_arrival.get(r.task_id) or measured[r.task_id] for _, r in pairs]
        sizes = [u.size for u in updates]
        statistics = measure_statistics([u.statistics for u in updates])
        screen_norms(sizes, policy, recent)
        statistics_outliers(statistics, policy.update_norm_factor)
        direction_outliers(direction_cosines(updates, layout, workspace), policy)
        # The divergence guard: a snapshot by reference, aggregation, the largest weight after it.
        meta = strategy.state_meta()
        snapshot = (dict(strategy.state_tensors()), json.loads(json.dumps(meta)) if meta else {})
        strategy.aggregate(round_index, pairs)
        after = largest_magnitude(strategy.global_state)
        del snapshot
        if not math.isfinite(after) or after > policy.divergence_factor * max(scale_before, 1.0):
            raise RuntimeError("the recorded honest round tripped the divergence guard")
        return spent + time.perf_counter() - started

    plain, guarded = [], []
    aggregate_only(), screened()  # warm-up
    for _ in range(repeats):
        plain.append(aggregate_only())
        guarded.append(screened())
    return median(guarded), median(plain), median(guarded) / median(plain)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tinycnn")
    parser.add_argument("--method", default="fedavg")
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument(
        "--aggregation",
        default="mean",
        choices=("mean", "trimmed_mean", "median"),
        help="[run] aggregation for every run, honest ones included (default: the methods' mean)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved timings of one recorded round (default 30, 3 with --quick)",
    )
    parser.add_argument(
        "--min-update-cosine",
        type=float,
        default=None,
        help="[run] min_update_cosine (default: the run default)",
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds: a smoke check, not a measurement")
    a = parser.parse_args(argv)
    if a.quick:
        a.rounds = 3
    if a.repeats is None:
        a.repeats = 3 if a.quick else 30
    torch.set_num_threads(1)
    from rich.progress import Progress

    recorder = Recorder()
    plan: list[tuple[str, Tamper | None, bool]] = [
        ("honest", recorder, True),
        ("honest_unscreened", None, False),
    ]
    plan += [(name, attack, True) for name, attack in ATTACKS.items()]
    runs: dict[str, dict] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, Progress(transient=True) as progress:
        bar = progress.add_task("robustness runs", total=len(plan))
        for name, tamper, screening in plan:
            progress.update(bar, description=name)
            runs[name] = one_run(a, Path(tmp), name, tamper, screening)
            progress.advance(bar)
    honest = runs["honest"]
    attacks = [runs[name] for name in ATTACKS]
    for run in runs.values():
        drop = 100 * (honest["accuracy"] - run["accuracy"])
        print(
            f"{run['name']:<22} accuracy {100 * run['accuracy']:6.2f}%  drop {drop:+6.2f} pts  "
            f"finished {run['finished']}  refused {run['refused']:3d}  aggregate {run['aggregate_seconds']:.3f}s"
            f"  quarantined {run['quarantined']}"
        )
    worst_drop = max(100 * (honest["accuracy"] - run["accuracy"]) for run in attacks)
    finished = sum(run["finished"] for run in attacks)
    in_run = honest["aggregate_seconds"] / max(runs["honest_unscreened"]["aggregate_seconds"], 1e-9)
    last = recorder.rounds[max(recorder.rounds)]
    screened_s, plain_s, overhead = interleaved_overhead(a.method, last, a.repeats)
    print(
        f"one honest round of {len(last)} results, {a.repeats} interleaved timings: screening + "
        f"guard + aggregation {1e3 * screened_s:.2f} ms, aggregation alone {1e3 * plain_s:.2f} ms "
        f"(whole runs, as the coordinator counted: x{in_run:.2f})"
    )
    print(
        f"{a.rounds} rounds, seed {a.seed}, {a.model}/{a.method}, aggregation {a.aggregation}; wall {time.perf_counter() - started:.0f}s; "
        f"honest screened == unscreened accuracy: {honest['accuracy'] == runs['honest_unscreened']['accuracy']}"
    )
    print(
        f"worst_acc_drop={worst_drop:.2f} runs_finished={finished}/{len(attacks)} honest_overhead={overhead:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
