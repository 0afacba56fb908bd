"""Robustness: one bad board among 10 against an honest run (issues 16 and 25).

Digits, 10 boards, every board every round, the same seed and rounds for every run; one attacker (board 0)
per run. The extreme attacks of issue 16 (every round instead of its trained result: huge finite values 3.0e38,
its update x100, its update sign-flipped, all-zero weights claiming 10**9 samples, BN running variances x10^4)
and the in-range ones of issue 25: BN running variances x9, 0 or 1e-30, running means +8 standard deviations
(honest weights), and inside any bound an honest round needs: variances x3.9 or x0.26, means +2.9 standard
deviations; a consistent sample-count lie (10**9 in the hello and in every result) with honest weights,
with noise and with label-flipped training; noise of its honest update's norm; a hello claiming another
board's index; a hostile hello field; a hostile result metric. Hellos go through the server's hello decoding
and registry (server/registry.py) and hostile results through the wire codec, as on a fleet; the rest through
the simulator's in-process transport (screening lives in the coordinator, which every transport goes through).
A client-id takeover needs a broker (tests/server/test_fleet_attacks.py and the broker-config tests).

Two honest runs, with screening (the default) and without (screen_updates and divergence_guard off), time the
coordinator's screening + aggregation side by side. A run that raises is a crash (the server would have exited).

Last line: `attacks=N crashes=C worst_acc_drop=<points> runs_finished=K/N honest_overhead=<with/without>`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from nestling.messages import Result, Task
from nestling.server.strategies.base import DeviceInfo

Tamper = Callable[[Task, Result], Result | None]
Hello = Callable[[list[DeviceInfo]], list[DeviceInfo]]
ATTACKER = "dev-00000"
LIE = 10**9


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
    return replace(zeroed, num_samples=LIE)


def _statistics(result: Result, change: Callable[[str, torch.Tensor, dict], torch.Tensor]) -> Result:
    """The attacker's result with its BN running statistics changed (honest weights otherwise)."""
    if result.device_id != ATTACKER:
        return result
    weights = dict(result.weights)
    return replace(result, weights={k: change(k, v, weights) for k, v in weights.items()})


def _is_variance(key: str) -> bool:
    name = key.rsplit(".", 1)[-1]
    return name == "running_var" or name.startswith("running_var_w")


def _is_mean(key: str) -> bool:
    name = key.rsplit(".", 1)[-1]
    return name == "running_mean" or name.startswith("running_mean_w")


def variances_times(factor: float) -> Tamper:
    """Every BN running variance x factor (finite: x10^4 is issue 16's; x9 stays under the norm screen, which
    allows x10 in standard deviations, x100 as a variance)."""

    def attack(task: Task, result: Result) -> Result:
        return _statistics(result, lambda k, v, _: v * factor if _is_variance(k) else v)

    return attack


def variances_set(value: float) -> Tamper:
    """Every BN running variance set to `value` (0 or 1e-30: every normalised activation blows up)."""

    def attack(task: Task, result: Result) -> Result:
        return _statistics(result, lambda k, v, _: torch.full_like(v, value) if _is_variance(k) else v)

    return attack


def means_by(sigmas: float) -> Tamper:
    """Every BN running mean moved by `sigmas` of its channel's standard deviations."""

    def attack(task: Task, result: Result) -> Result:
        def change(key: str, value: torch.Tensor, weights: dict) -> torch.Tensor:
            variance = weights.get(key.replace("running_mean", "running_var")) if _is_mean(key) else None
            return value + sigmas * variance.clamp_min(0).sqrt() if variance is not None else value

        return _statistics(result, change)

    return attack


def _noise(task: Task, result: Result, times: float) -> Result:
    """The attacker's trained tensors replaced by Gaussian noise of `times` its honest update's L2 norm."""
    from nestling.models.layers import is_running_statistic

    if result.device_id != ATTACKER:
        return result
    keys = [k for k, v in result.weights.items() if v.is_floating_point() and not is_running_statistic(k)]
    honest = math.sqrt(sum(float((result.weights[k] - task.weights[k]).double().pow(2).sum()) for k in keys))
    generator = torch.Generator().manual_seed(task.round)
    noise = {k: torch.randn(result.weights[k].shape, generator=generator) for k in keys}
    size = math.sqrt(sum(float(n.double().pow(2).sum()) for n in noise.values()))
    weights = dict(result.weights)
    for k in keys:
        weights[k] = task.weights[k] + noise[k] * (times * honest / max(size, 1e-12))
    return replace(result, weights=weights)


def noise_honest_norm(task: Task, result: Result) -> Result:
    return _noise(task, result, 1.0)


def lying(tamper: Tamper | None = None) -> Tamper:
    """Every result claims 10**9 samples (its hello did too, see `lying_hello`), after `tamper`."""

    def attack(task: Task, result: Result) -> Result | None:
        changed = tamper(task, result) if tamper is not None else result
        if changed is None or changed.device_id != ATTACKER:
            return changed
        return replace(changed, num_samples=LIE)

    return attack


def noisy(task: Task, result: Result) -> Result:
    """Noise 5x its honest update's norm: under the x10 norm screen."""
    return _noise(task, result, 5.0)


class LabelFlipped:
    """The attacker's result trained on its own data with every label c turned into 9 - c (the run's task,
    its own store), in place of what it trained honestly."""

    def __init__(self, cfg: Any) -> None:
        from nestling.simulator.batched import BatchPolicy
        from nestling.simulator.fleetdata import load_fleet_data
        from nestling.simulator.run import fleet_args

        self.fleet = load_fleet_data(**fleet_args(cfg))
        self.policy = BatchPolicy()
        self.stores: dict = {}

    def _data(self, device: str) -> Any:
        data = self.fleet.client(device)
        return replace(data, y=(self.fleet.bundle.num_classes - 1) - data.y)

    def __call__(self, task: Task, result: Result) -> Result:
        from nestling.simulator.batched import run_tasks

        if result.device_id != ATTACKER:
            return result
        (flipped,) = run_tasks([task], self._data, self.stores, "cpu", self.policy)
        return replace(flipped, num_samples=result.num_samples)


def _register(devices: list[DeviceInfo], profiles: dict[str, dict[str, Any]]) -> list[DeviceInfo]:
    """The boards as the server registers them from hellos (attacker first: it says hello first), each hello
    encoded and decoded by the wire codec and admitted by server/registry.py. A refused hello leaves its board
    out of the fleet. The partition's label sets are kept (the server's view of what each board holds)."""
    from nestling.errors import NestlingError
    from nestling.server.registry import DeviceRegistry
    from nestling.wire.fleet_messages import decode_hello, encode_hello

    registry = DeviceRegistry()
    registered = []
    for device in sorted(devices, key=lambda d: d.device_id != ATTACKER):
        profile = profiles.get(device.device_id, {"num_samples": device.num_samples, "index": device.index})
        try:
            device_id, decoded = decode_hello(encode_hello(device.device_id, profile))
            info = registry.register(device_id, decoded, 0.0)
        except (NestlingError, ValueError, TypeError) as exc:
            print(f"  hello of {device.device_id} refused: {exc}")
            continue
        if device.device_id == ATTACKER:  # honest boards keep what the simulator gives them
            device = replace(device, num_samples=info.num_samples, profile=info.profile)
        registered.append(replace(device, index=info.index))
    return sorted(registered, key=lambda d: d.device_id)


def hello_with(**fields: Any) -> Hello:
    """The attacker's hello carries these fields beside its honest sample count and index."""

    def hello(devices: list[DeviceInfo]) -> list[DeviceInfo]:
        attacker = next(d for d in devices if d.device_id == ATTACKER)
        profile = {"num_samples": attacker.num_samples, "index": attacker.index, **fields}
        return _register(devices, {ATTACKER: profile})

    return hello


def hostile_metric(task: Task, result: Result) -> Result | None:
    """A result whose metrics say train_seconds "fast" and loss_mean "low", through the wire codec as a
    fleet's would come (None: the server's decoding refused it)."""
    from nestling.errors import NestlingError
    from nestling.wire.codec import decode_message
    from nestling.wire.fleet_messages import decode_result, encode_result

    if result.device_id != ATTACKER:
        return result
    hostile = replace(result, metrics={**result.metrics, "train_seconds": "fast", "loss_mean": "low"})
    try:
        decoded, _ = decode_result(decode_message(encode_result(hostile, "session")))
    except NestlingError:
        return None
    return decoded


@dataclass(frozen=True)
class Attack:
    """What the attacker sends: `tamper` for its results, `hello` for its registration; `flips` trains it on
    flipped labels (a LabelFlipped, built per run), and `tamper_after` is applied to that result."""

    tamper: Tamper | None = None
    hello: Hello | None = None
    kind: str = "extreme"
    flips: bool = False


ATTACKS: dict[str, Attack] = {
    "huge_values": Attack(huge),
    "scaled_x100": Attack(scaled),
    "sign_flipped": Attack(sign_flipped),
    "inflated_num_samples": Attack(inflated),
    "inflated_bn_variance": Attack(variances_times(1.0e4)),
    "bn_variance_x9": Attack(variances_times(9.0), kind="in-range"),
    "bn_variance_zero": Attack(variances_set(0.0), kind="in-range"),
    "bn_variance_1e-30": Attack(variances_set(1e-30), kind="in-range"),
    "bn_mean_8_sigma": Attack(means_by(8.0), kind="in-range"),
    # inside any bound an honest round needs (variance_factor 4, mean_sigmas 3): only the median stops them
    "bn_variance_x3.9": Attack(variances_times(3.9), kind="in-range"),
    "bn_variance_x0.26": Attack(variances_times(0.26), kind="in-range"),
    "bn_mean_2.9_sigma": Attack(means_by(2.9), kind="in-range"),
    "sample_lie_honest": Attack(lying(), hello_with(num_samples=LIE), kind="in-range"),
    "sample_lie_noise": Attack(lying(noisy), hello_with(num_samples=LIE), kind="in-range"),
    "sample_lie_label_flip": Attack(lying(), hello_with(num_samples=LIE), kind="in-range", flips=True),
    "label_flip": Attack(None, kind="in-range", flips=True),  # its true sample count: the lie's baseline
    "noise_honest_norm": Attack(noise_honest_norm, kind="in-range"),
    "index_claim": Attack(None, hello_with(index=1), kind="in-range"),
    "hostile_hello_field": Attack(None, hello_with(tier="abc"), kind="wire"),
    "hostile_result_metric": Attack(hostile_metric, kind="wire"),
}


def config(a: argparse.Namespace, screening: bool, seed: int | None = None) -> Any:
    from nestling.config import config_from_dict

    return config_from_dict(
        {
            "run": {
                "rounds": a.rounds,
                "seed": a.seed if seed is None else seed,
                "quorum": 0.6,
                "eval_every": a.rounds,
                "checkpoint_every": 0,
                "workers": 1,
                "screen_updates": screening,
                "divergence_guard": screening,
                "aggregation": a.aggregation,
                "bn_statistics": a.bn_statistics,
                "cohort_screen": screening and a.cohort_screen == "on",
                **({} if a.min_update_cosine is None else {"min_update_cosine": a.min_update_cosine}),
            },
            "data": {"dataset": "digits", "clients": 10, "partition": a.partition, "alpha": a.alpha},
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
    a: argparse.Namespace,
    work: Path,
    name: str,
    attack: Attack | None,
    screening: bool = True,
    recorder: Tamper | None = None,
    seed: int | None = None,
) -> dict:
    """One run; an exception is a crash (the server would have exited), reported, not raised."""
    from nestling.simulator.run import run_simulation

    cfg = config(a, screening, seed)
    tamper = recorder
    if attack is not None:
        tamper = attack.tamper
        if attack.flips:
            flipped, after = LabelFlipped(cfg), attack.tamper

            def tamper(task: Task, result: Result) -> Result | None:
                trained = flipped(task, result)
                return after(task, trained) if after is not None else trained

    try:
        summary = run_simulation(
            cfg,
            work / name,
            tamper=tamper,
            hello=attack.hello if attack is not None else None,
            overwrite=True,
        )
    except Exception as exc:  # the benchmark counts what a server would die of
        return {
            "name": name,
            "accuracy": None,
            "finished": False,
            "crash": f"{type(exc).__name__}: {str(exc)[:120]}",
            "aggregate_seconds": 0.0,
            "quarantined": [],
            "refused": 0,
            "bounded": 0,
        }
    metrics = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines() if line]
    counters = [m["counters"] for m in metrics]
    return {
        "name": name,
        "accuracy": summary["worst_accuracy"],
        "finished": len(metrics) == a.rounds,
        "crash": None,
        "aggregate_seconds": summary["aggregate_seconds"],
        "quarantined": summary["quarantined"],
        "refused": sum(sum(v for k, v in c.items() if k.startswith("rejected_")) for c in counters),
        "bounded": sum(c.get("bounded_num_samples", 0) for c in counters),
    }


class Recorder:
    """A tamper that changes nothing and keeps the last round's (task, result) pairs, for the timing below."""

    def __init__(self) -> None:
        self.rounds: dict[int, list[tuple[Task, Result]]] = {}

    def __call__(self, task: Task, result: Result) -> Result:
        self.rounds.setdefault(task.round, []).append((task, result))
        return result


def interleaved_overhead(
    method: str, pairs: list[tuple[Task, Result]], repeats: int, policy: Any = None
) -> tuple[float, float, float]:
    """Median seconds of one recorded honest round through the coordinator's own screening and guarded
    aggregation (server/result_admission.py and divergence_guard.py, timed by their own counters, as the
    coordinator's summary reports them) and of the strategy's aggregation alone, timed alternately `repeats`
    times on fresh strategies (a noisy machine slows both alike); and their ratio."""
    import logging
    from collections import Counter
    from statistics import median

    from nestling.server.divergence_guard import DivergenceGuard
    from nestling.server.refusals import RefusalLog
    from nestling.server.result_admission import ResultAdmission
    from nestling.server.screening import RobustPolicy, largest_magnitude
    from nestling.server.strategies import StrategyContext, create_strategy
    from nestling.server.strategies.context import DeviceInfo
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
    policy = policy if policy is not None else RobustPolicy()
    round_index = pairs[0][0].round
    boards = [DeviceInfo(r.device_id, i, r.num_samples) for i, (_, r) in enumerate(pairs)]
    by_task = {task.task_id: task for task, _ in pairs}
    # The coordinator keeps its admission (update buffers, the global layout, each board's record) and the
    # global model's largest |w| (measured after the previous round's aggregation) from round to round.
    admission = ResultAdmission(create_strategy(method, ctx), policy, RefusalLog(logging.getLogger("bench")))
    scale = largest_magnitude(admission.strategy.global_state)

    def aggregate_only() -> float:
        strategy = create_strategy(method, ctx)
        for task, result in pairs:
            strategy.validate(task, result)
        started = time.perf_counter()
        strategy.aggregate(round_index, pairs)
        return time.perf_counter() - started

    def screened() -> float:
        """Each result admitted as it arrives (validated, and measured unless packed: nestling/packed.py), then
        the round's screens and the guarded aggregation; what the coordinator counts as their cost."""
        strategy = admission.strategy = create_strategy(method, ctx)
        guard = DivergenceGuard(strategy, policy, scale=scale)
        admission.seen_tasks.clear()
        admission.new_round(boards, boards, len(pairs))
        admission.seconds = 0.0
        for _, result in pairs:
            if admission.admit(round_index, by_task, result) is not None:
                raise RuntimeError(f"the recorded honest round had {result.device_id}'s result refused")
        counters: Counter[str] = Counter()
        accepted = admission.screen(round_index, pairs, counters)
        if len(accepted) != len(pairs) or not guard.aggregate(round_index, accepted, counters):
            raise RuntimeError(f"the recorded honest round was screened or rolled back: {dict(counters)}")
        return admission.seconds + guard.seconds

    plain, guarded = [], []
    aggregate_only(), screened()  # warm-up
    for _ in range(repeats):
        plain.append(aggregate_only())
        guarded.append(screened())
    return median(guarded), median(plain), median(guarded) / median(plain)


def _line(run: dict, honest: dict) -> str:
    kind = ATTACKS[run["name"]].kind if run["name"] in ATTACKS else "honest"
    if run["crash"]:
        return f"{run['name']:<22} {kind:<8} CRASHED  {run['crash']}"
    drop = 100 * (honest["accuracy"] - run["accuracy"])
    return (
        f"{run['name']:<22} {kind:<8} accuracy {100 * run['accuracy']:6.2f}%  drop {drop:+6.2f} pts  "
        f"finished {run['finished']}  refused {run['refused']:3d}  bounded {run['bounded']:3d}  "
        f"aggregate {run['aggregate_seconds']:.3f}s  quarantined {run['quarantined']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--seed",
        type=int,
        nargs="+",
        default=[0],
        help="one or more seeds: each attack is judged by its mean drop over them (each against its seed's "
        "honest run)",
    )
    parser.add_argument("--model", default="tinycnn")
    parser.add_argument("--method", default="fedavg")
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--partition", default="iid", choices=("iid", "dirichlet"))
    parser.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (with --partition)")
    parser.add_argument(
        "--cohort-screen",
        default="on",
        choices=("on", "off"),
        help="[run] cohort_screen in the screened runs (server/update_cohort.py; default on, as the run default)",
    )
    parser.add_argument(
        "--aggregation",
        default="mean",
        choices=("mean", "trimmed_mean", "median"),
        help="[run] aggregation for every run, honest ones included (default: the methods' mean)",
    )
    parser.add_argument(
        "--bn-statistics",
        default="median",
        choices=("median", "mean"),
        help="[run] bn_statistics for every run (default median, the run default; mean: the papers')",
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
    parser.add_argument(
        "--only", nargs="+", choices=sorted(ATTACKS), help="run these attacks only (default: all)"
    )
    a = parser.parse_args(argv)
    seeds, a.seed = a.seed, a.seed[0]
    if a.quick:
        a.rounds = 3
    if a.repeats is None:
        a.repeats = 3 if a.quick else 30
    torch.set_num_threads(1)
    from rich.progress import Progress

    recorder = Recorder()
    plan: list[tuple[str, Attack | None, bool]] = [("honest", None, True), ("honest_unscreened", None, False)]
    chosen = [name for name in ATTACKS if not a.only or name in a.only]
    plan += [(name, ATTACKS[name], True) for name in chosen]
    by_seed: dict[int, dict[str, dict]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, Progress(transient=True) as progress:
        bar = progress.add_task("robustness runs", total=len(plan) * len(seeds))
        for seed in seeds:
            runs = by_seed[seed] = {}
            for name, attack, screening in plan:
                progress.update(bar, description=f"seed {seed} {name}")
                record = recorder if name == "honest" and seed == seeds[0] else None
                runs[name] = one_run(a, Path(tmp), f"{name}-{seed}", attack, screening, record, seed)
                runs[name]["name"] = name
                progress.advance(bar)
    for seed, runs in by_seed.items():
        if len(seeds) > 1:
            print(f"seed {seed}")
        for run in runs.values():
            print(_line(run, runs["honest"]))
    crashes = sum(any(runs[name]["crash"] is not None for runs in by_seed.values()) for name in chosen)
    mean_drops = {}
    for name in chosen:
        drops = [
            100 * (runs["honest"]["accuracy"] - runs[name]["accuracy"])
            for runs in by_seed.values()
            if runs[name]["crash"] is None
        ]
        if drops:
            mean_drops[name] = sum(drops) / len(drops)
    if len(seeds) > 1:
        print(
            f"mean drop over seeds {seeds}: "
            + ", ".join(f"{name} {drop:+.2f}" for name, drop in mean_drops.items())
        )
    worst_drop = max(mean_drops.values()) if mean_drops else math.nan
    finished = sum(all(runs[name]["finished"] for runs in by_seed.values()) for name in chosen)
    first = by_seed[seeds[0]]
    in_run = first["honest"]["aggregate_seconds"] / max(first["honest_unscreened"]["aggregate_seconds"], 1e-9)
    last = recorder.rounds[max(recorder.rounds)]
    from nestling.server.screening import robust_policy

    policy = robust_policy(config(a, True).run)
    screened_s, plain_s, overhead = interleaved_overhead(a.method, last, a.repeats, policy)
    print(
        f"one honest round of {len(last)} results, {a.repeats} interleaved timings: screening + "
        f"guard + aggregation {1e3 * screened_s:.2f} ms, aggregation alone {1e3 * plain_s:.2f} ms "
        f"(whole runs, as the coordinator counted: x{in_run:.2f})"
    )
    same = all(r["honest"]["accuracy"] == r["honest_unscreened"]["accuracy"] for r in by_seed.values())
    partition = a.partition if a.partition == "iid" else f"dirichlet({a.alpha:g})"
    print(
        f"{a.rounds} rounds, seeds {seeds}, {a.model}/{a.method}, {partition}, aggregation {a.aggregation}, "
        f"BN statistics {a.bn_statistics}, cohort screen {a.cohort_screen}; wall {time.perf_counter() - started:.0f}s; "
        f"honest screened == unscreened accuracy: {same}"
    )
    print(
        f"attacks={len(chosen)} crashes={crashes} worst_acc_drop={worst_drop:.2f} "
        f"runs_finished={finished}/{len(chosen)} honest_overhead={overhead:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
