"""Planning from measured profiles against index tiers, with a round deadline and a board slowed 2× mid-run (issue 12).

Eight devices of four catalogue classes (Raspberry Pi 4, low-end phone, Raspberry Pi 5, Jetson Nano; two each,
registered in an order that has nothing to do with their speed) train NeFL-WD on digits under a round deadline.
Two runs, same seed, rounds, data and selection: **profiled** — every board sent its emulated class's profile
(what `nestling agent --emulate CLASS` reports) and the server sizes it with profiler/fit.py, corrects it with
what it observes and re-plans; **tiers** — no profiles, NeFL's tiers by registration index as before. In both,
one Jetson Nano trains 2× slower for a stretch of rounds (an injected slowdown, `[device] emulate_slowdown`).

The fleet is the simulator's in-process transport on the virtual clock with simulator/emulated_fleet.py: each
device's training and transfers take exactly what an emulating agent pads itself to (benchmarks/fidelity.py
holds replay and loopback fleet to each other), so eight boards run on one core without the host's speed
entering. The host's own prediction error is measured for real: this host profiles itself once
(edge/self_profile.measure_profile: per-part latencies and the narrow point) and its prediction for each trained
submodel × its steps is compared with the training time the host really took for every task of both runs. This
host is shared: it profiles itself again at the end (how far its speed moved meanwhile), and the same predictions
corrected as the server corrects a board's (profiler.fit.SpeedFeedback over the tasks in order) are printed too.

Per run it also prints each board's accuracy on the submodel it deploys (mean, worst board), every NeFL member's
accuracy, and how many results the update screen refused. A member no board trains keeps NeFL's initial
per-member BN statistics and scores chance (10 %): with flex 0 that is every member no board is sized to.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.planning [--quick]
Last line: `deadline_hit_profiled=… deadline_hit_tiers=… time_pred_median_err=… replan_rounds=…` — board-rounds
finished within the deadline (result arrived), median relative error of the host's predicted local training
time, and rounds from the slowdown's first round until the slowed board trains a smaller submodel.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from nestling.messages import Result, Task

CLASSES = ("jetson-nano", "rpi4", "rpi5", "phone-low", "rpi4", "jetson-nano", "phone-low", "rpi5")
SLOWED = "dev-00000"  # a Jetson Nano
LOCAL_EPOCHS = 3
# The deadline leaves local training HEADROOM × what the fastest class needs for the full model: a Jetson Nano
# slowed 2x no longer fits it, and the slow classes must train smaller submodels.
HEADROOM = 1.6


@dataclass
class RunOutcome:
    name: str
    deadline_s: float
    hits: int = 0
    board_rounds: int = 0
    specs: dict[str, list[str]] = field(default_factory=dict)  # device -> spec id per round
    memory: dict[str, float] = field(default_factory=dict)  # spec id -> estimated training bytes
    host: list[tuple[float, float]] = field(default_factory=list)  # (predicted, measured) host seconds
    host_by_macs: list[tuple[float, float]] = field(default_factory=list)  # the same without the narrow point
    emulated: list[tuple[float, float]] = field(default_factory=list)  # (predicted, observed) board seconds
    replans: list[dict[str, Any]] = field(default_factory=list)
    # Each board's accuracy on the submodel it deploys (server/run_report.board_accuracy), and every member's.
    boards: dict[str, float] = field(default_factory=dict)
    members: dict[str, float] = field(default_factory=dict)
    refused: int = 0  # results the coordinator's update screen refused (rejected_update_norm / _direction)


def run(
    profiled: bool,
    *,
    rounds: int,
    slow_from: int,
    slow_until: int,
    deadline_s: float,
    host_board: Any,
    seed: int = 0,
    model: str = "resnet20",
    limit_train: int | None = None,
) -> RunOutcome:
    """One fleet run on the virtual clock; `host_board` is this host's measured profile (prediction check)."""
    from nestling.edge.emulation import EmulationTarget
    from nestling.profiler.catalogue import BOARDS
    from nestling.profiler.estimator import estimate
    from nestling.profiler.speed import samples_trained, steps_trained
    from nestling.schedule import LrSchedule
    from nestling.server.clock import VirtualClock
    from nestling.server.coordinator import Coordinator, RoundPolicy
    from nestling.server.evaluation import Evaluator
    from nestling.server.run_report import board_accuracy
    from nestling.server.strategies import StrategyContext, create_strategy
    from nestling.server.strategies.base import DeviceInfo
    from nestling.simulator.backend import InProcessBackend
    from nestling.simulator.emulated_fleet import EmulatedBoards
    from nestling.simulator.emulated_fleet import profiled as with_profiles
    from nestling.simulator.fleetdata import device_id, load_fleet_data
    from nestling.simulator.inprocess import InProcessTransport
    from nestling.spec import SubmodelSpec

    fleet_data = load_fleet_data("digits", None, seed, "iid", len(CLASSES), {}, limit_train=limit_train)
    bundle = fleet_data.bundle
    local = {"local_epochs": LOCAL_EPOCHS, "batch_size": 32, "momentum": 0.9, "weight_decay": 0.0}
    ctx = StrategyContext(
        arch=model,
        num_classes=bundle.num_classes,
        in_channels=bundle.input_shape[0],
        image_size=bundle.input_shape[1],
        num_clients=len(CLASSES),
        total_rounds=rounds,
        seed=seed,
        schedule=LrSchedule("constant", 0.05),
        local=local,
        options={"flex": 0},
        deadline_s=deadline_s,
    )
    strategy = create_strategy("nefl-wd", ctx)
    boards: dict[str, EmulationTarget] = {}
    devices = []
    for index, name in enumerate(CLASSES):
        dev = device_id(index)
        target = EmulationTarget.of_board(BOARDS[name])
        if dev == SLOWED:
            target = EmulationTarget(
                target.name,
                target.figures,
                memory_bytes=target.memory_bytes,
                slowdown=((slow_from, slow_until, 2.0),),
            )
        boards[dev] = target
        devices.append(DeviceInfo(dev, index, len(fleet_data.parts[index])))
    profiles = with_profiles(devices, boards, strategy.full_spec, strategy.batch_size)
    if deadline_s <= 0:  # automatic: see HEADROOM
        fastest = profiles[0].board
        assert fastest is not None
        n = profiles[0].num_samples
        needed = fastest.train_seconds(strategy.full_spec, samples_trained(local, n), steps_trained(local, n))
        deadline_s = HEADROOM * needed / ctx.train_share
        ctx.deadline_s = deadline_s
    if profiled:
        devices = profiles
    samples = {d.device_id: d.num_samples for d in devices}
    fleet = EmulatedBoards(boards, samples, bundle.input_shape)
    clock = VirtualClock()
    outcome = RunOutcome("profiled" if profiled else "tiers", deadline_s=deadline_s)

    # MAC scaling alone: the prediction before the narrow point and the cost per task
    by_macs = replace(host_board, narrow=None, task_s=None)

    def watch(task: Task, result: Result) -> None:  # read-only: the host's real training time of each task
        spec = SubmodelSpec.from_dict(task.spec)
        trained = samples_trained(task.hparams, samples[task.device_id])
        steps = steps_trained(task.hparams, samples[task.device_id])
        observed = float(result.metrics["train_seconds"])
        outcome.host.append((host_board.train_seconds(spec, trained, steps), observed))
        outcome.host_by_macs.append((by_macs.train_seconds(spec, trained), observed))

    transport = InProcessTransport(
        devices, InProcessBackend(fleet_data.client), clock, fleet, observers=[watch]
    )
    evaluator = Evaluator(bundle.test.x, bundle.test.y, batch_size=256)
    policy = RoundPolicy(
        rounds=rounds,
        fraction=1.0,
        quorum=0.0,
        deadline_s=deadline_s,
        eval_every=rounds,
        checkpoint_every=0,
        seed=seed,
    )
    coordinator = Coordinator(strategy, transport, clock, evaluator, policy)
    for record in coordinator.run():
        for event in transport.drain_events():
            outcome.board_rounds += 1
            outcome.hits += int(event.ends_at - event.dispatched_at <= deadline_s)
            outcome.specs.setdefault(event.device_id, []).append(event.spec_id)
        for plan in record.plans.values():
            if "observed_s" in plan and not plan["censored"]:
                outcome.emulated.append((plan["predicted_s"], plan["observed_s"]))
        outcome.replans += [{**r, "round": record.round} for r in record.replans]
        outcome.refused += sum(v for k, v in record.counters.items() if k.startswith("rejected_update"))
    outcome.members = {e.name: e.accuracy for e in coordinator.last_eval}
    deployed = board_accuracy(strategy, devices, coordinator.last_eval, rounds - 1) or {"boards": {}}
    outcome.boards = {d: b["accuracy"] for d, b in deployed["boards"].items()}
    for spec in strategy.specs:
        outcome.memory[spec.id] = float(estimate(spec, strategy.batch_size).training_bytes)
    return outcome


def replan_rounds(outcome: RunOutcome, slow_from: int) -> int | None:
    """Rounds from the slowdown's first round until the slowed board trains a smaller submodel than before."""
    specs = outcome.specs[SLOWED]
    before = outcome.memory[specs[slow_from - 1]]
    for r in range(slow_from, len(specs)):
        if outcome.memory[specs[r]] < before:
            return r - slow_from
    return None


def recovered_after(outcome: RunOutcome, slow_until: int) -> int | None:
    """Rounds after the slowdown ended until the slowed board is back on its original submodel."""
    specs = outcome.specs[SLOWED]
    original = specs[0]
    for r in range(slow_until, len(specs)):
        if specs[r] == original:
            return r - slow_until
    return None


def median_error(pairs: list[tuple[float, float]]) -> float:
    return statistics.median(abs(p - o) / o for p, o in pairs if o > 0) if pairs else float("nan")


def corrected_pairs(pairs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Each prediction × the speed factor the server's feedback would hold after the tasks before it: what the
    planner predicts for a board whose speed drifts (here: a shared host's load)."""
    from nestling.profiler.fit import SpeedFeedback

    feedback = SpeedFeedback()
    out = []
    for predicted, observed in pairs:
        out.append((predicted * feedback.factor("host"), observed))
        feedback.observe("host", predicted, observed)
    return out


def host_profile(model: str) -> tuple[Any, Any]:
    """This host measures the full NeFL-WD model at batch 32, as an agent does on first start: (profile, spec)."""
    from nestling.data import load_dataset
    from nestling.edge.self_profile import ProfileInputs, measure_profile
    from nestling.server.strategies import StrategyContext, create_strategy

    bundle = load_dataset("digits", None, seed=0)
    ctx = StrategyContext(model, bundle.num_classes, bundle.input_shape[0], bundle.input_shape[1], 8, 1)
    spec = create_strategy("nefl-wd", ctx).full_spec
    return measure_profile(ProfileInputs(spec.to_dict(), 32, "cpu", 0.2), repeats=10, warmup=3), spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument(
        "--deadline", type=float, default=0.0, help="round deadline in seconds (default: from HEADROOM)"
    )
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="6 rounds on all of digits: a smoke check, not a measurement (fewer samples would make the tasks "
        "shorter than the boards' transfers, so the automatic deadline would fit no board)",
    )
    a = parser.parse_args(argv)
    if a.quick:
        a.rounds = 6
    torch.set_num_threads(1)
    slow_from, slow_until = a.rounds // 3, 2 * a.rounds // 3
    started = time.perf_counter()
    board, full_spec = host_profile(a.model)
    kwargs = dict(
        rounds=a.rounds, slow_from=slow_from, slow_until=slow_until, deadline_s=a.deadline, host_board=board,
        seed=a.seed, model=a.model,
    )  # fmt: skip
    profiled = run(True, **kwargs)  # type: ignore[arg-type]
    tiers = run(False, **kwargs)  # type: ignore[arg-type]
    for outcome in (profiled, tiers):
        accuracy = list(outcome.boards.values()) or [float("nan")]
        members = " ".join(f"{name} {100 * acc:.1f}" for name, acc in outcome.members.items())
        print(
            f"{outcome.name:<9} deadline hit {outcome.hits}/{outcome.board_rounds}  deployed accuracy mean "
            f"{100 * statistics.mean(accuracy):.1f}% worst board {100 * min(accuracy):.1f}%  re-plans "
            f"{len(outcome.replans)}  updates refused by the screen {outcome.refused}  (members: {members})"
        )
        for dev, specs in sorted(outcome.specs.items()):
            sizes = " ".join(f"{outcome.memory[s] / 1e6:.1f}" for s in specs)
            print(f"  {dev} {CLASSES[int(dev[-5:])]:<12} training MB per round: {sizes}")
    for r in profiled.replans:
        print(f"  re-plan round {r['round']}: {r['device']} {r['reason']} speed x{r['speed']:.2f}")
    replan = replan_rounds(profiled, slow_from)
    back = recovered_after(profiled, slow_until)
    host_err = median_error(profiled.host + tiers.host)
    again, _ = host_profile(a.model)
    print(
        f"host full step {board.step_s * 1000:.1f} ms at the start, {again.step_s * 1000:.1f} ms at the end "
        f"(x{again.step_s / board.step_s:.2f}); narrow point {board.narrow.step_s * 1000 if board.narrow else 0:.1f} "
        f"ms, fixed {board.fixed_step_s(full_spec.model) * 1000:.1f} ms per step; host prediction corrected "
        f"by the feedback: median error {median_error(corrected_pairs(profiled.host) + corrected_pairs(tiers.host)):.3f}; "
        f"by MAC scaling alone (no narrow point), same tasks: {median_error(profiled.host_by_macs + tiers.host_by_macs):.3f}"
    )
    print(
        f"{a.rounds} rounds, deadline {profiled.deadline_s:.2f}s, {a.model}, slowdown x2 of {SLOWED} in rounds "
        f"[{slow_from}, {slow_until}); back on its submodel {back} rounds after; emulated-board prediction "
        f"median error {median_error(profiled.emulated):.3f}; host prediction over {len(profiled.host + tiers.host)} "
        f"tasks; wall {time.perf_counter() - started:.0f}s"
    )
    print(
        f"deadline_hit_profiled={profiled.hits / profiled.board_rounds:.3f} "
        f"deadline_hit_tiers={tiers.hits / tiers.board_rounds:.3f} time_pred_median_err={host_err:.3f} "
        f"replan_rounds={replan if replan is not None else 'none'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
