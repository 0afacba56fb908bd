"""The closed loop on a replayed fleet of emulated boards: a board slowed 2x mid-run moves to a smaller
submodel within two rounds and back when it recovers; predicted vs observed times and re-plans are recorded."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from nestling.edge.emulation import EmulationTarget
from nestling.profiler.catalogue import get_board
from nestling.profiler.estimator import estimate
from nestling.profiler.speed import samples_trained
from nestling.schedule import LrSchedule
from nestling.server.clock import VirtualClock
from nestling.server.coordinator import Coordinator, RoundPolicy
from nestling.server.plan_summary import summarise_plans
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.server.strategies.base import DeviceInfo, Strategy
from nestling.simulator.backend import InProcessBackend
from nestling.simulator.emulated_fleet import EmulatedBoards, profiled
from nestling.simulator.fleetdata import device_id, load_fleet_data
from nestling.simulator.inprocess import InProcessTransport

ROUNDS, SLOW_FROM, SLOW_UNTIL = 8, 2, 4


def test_a_board_slowed_mid_run_is_sized_down_within_two_rounds_and_back_after(tmp_path: Path) -> None:
    data = load_fleet_data("digits", None, 0, "iid", 2, {}, limit_train=160)
    local = {"local_epochs": 2, "batch_size": 32, "momentum": 0.9}
    ctx = StrategyContext(
        "resnet20", 10, 1, 16, num_clients=2, total_rounds=ROUNDS, local=local, options={"flex": 0},
        schedule=LrSchedule("constant", 0.05),
    )  # fmt: skip
    strategy = create_strategy("nefl-wd", ctx)
    nano = EmulationTarget.of_board(get_board("jetson-nano"))
    slowed = EmulationTarget(
        nano.name, nano.figures, memory_bytes=nano.memory_bytes, slowdown=((SLOW_FROM, SLOW_UNTIL, 2.0),)
    )
    boards = {device_id(0): slowed, device_id(1): EmulationTarget.of_board(get_board("rpi4"))}
    devices = profiled(
        [DeviceInfo(device_id(i), i, len(data.parts[i])) for i in range(2)], boards, strategy.full_spec, 32
    )
    board = devices[0].board
    assert board is not None
    full_s = board.train_seconds(strategy.full_spec, samples_trained(local, devices[0].num_samples))
    # Training may take 1.4x the full model's time (slowed 2x it no longer fits); transfers get 0.6 s more.
    ctx.deadline_s = 1.4 * full_s + 0.6
    ctx.train_share = 1.4 * full_s / ctx.deadline_s
    clock = VirtualClock()
    fleet = EmulatedBoards(boards, {d.device_id: d.num_samples for d in devices}, (1, 16, 16))
    transport = InProcessTransport(devices, InProcessBackend(data.client), clock, fleet)
    policy = RoundPolicy(
        rounds=ROUNDS, fraction=1.0, quorum=0.0, deadline_s=ctx.deadline_s, eval_every=0, checkpoint_every=0
    )
    Coordinator(strategy, transport, clock, None, policy, tmp_path).run()

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    memory = {s.id: estimate(s, 32).training_bytes for s in strategy.specs}
    trained = [memory[r["plans"][device_id(0)]["spec"]] for r in records]
    before = trained[SLOW_FROM - 1]
    assert trained[:SLOW_FROM] == [memory[strategy.full_spec.id]] * SLOW_FROM  # the fast board: full model
    moved = next(r for r in range(SLOW_FROM, ROUNDS) if trained[r] < before)
    assert moved - SLOW_FROM <= 2, trained  # sized down within two rounds of the slowdown
    assert trained[-1] == before, trained  # and back once it recovered
    plans = [r["plans"][device_id(0)] for r in records]
    first_slow = plans[SLOW_FROM]
    assert first_slow["observed_s"] > 1.9 * first_slow["raw_predicted_s"] and first_slow["speed_after"] > 1.5
    assert plans[0]["observed_s"] == plans[0]["predicted_s"]  # an emulated board trains what it reported
    replans = [r for rec in records for r in rec.get("replans", []) if r["device"] == device_id(0)]
    assert len(replans) >= 2 and replans[0]["reason"] == "time-bound"
    assert all(r["plans"][device_id(1)]["reason"] in ("time-bound", "fallback") for r in records)


def _slowed_fleet(rounds: int, out: Path, local: dict) -> tuple[Coordinator, Strategy]:
    """jetson-nano slowed 2x in rounds [2, 4) and an rpi4 on one local step each: plans are the emulated
    boards' (virtual time), so two runs of it plan identically whatever this host does."""
    data = load_fleet_data("digits", None, 0, "iid", 2, {}, limit_train=96)
    ctx = StrategyContext(
        "resnet20", 10, 1, 16, num_clients=2, total_rounds=rounds, local=local, options={"flex": 0},
        schedule=LrSchedule("constant", 0.05),
    )  # fmt: skip
    strategy = create_strategy("nefl-wd", ctx)
    nano = EmulationTarget.of_board(get_board("jetson-nano"))
    boards = {
        device_id(0): replace(nano, slowdown=((SLOW_FROM, SLOW_UNTIL, 2.0),)),
        device_id(1): EmulationTarget.of_board(get_board("rpi4")),
    }
    devices = profiled(
        [DeviceInfo(device_id(i), i, len(data.parts[i])) for i in range(2)], boards, strategy.full_spec, 32
    )
    full_s = devices[0].board.train_seconds(  # type: ignore[union-attr]
        strategy.full_spec, samples_trained(local, devices[0].num_samples)
    )
    ctx.deadline_s, ctx.train_share = 1.4 * full_s + 0.6, 1.4 * full_s / (1.4 * full_s + 0.6)
    clock = VirtualClock()
    fleet = EmulatedBoards(boards, {d.device_id: d.num_samples for d in devices}, (1, 16, 16))
    transport = InProcessTransport(devices, InProcessBackend(data.client), clock, fleet)
    policy = RoundPolicy(rounds=rounds, fraction=1.0, quorum=0.0, deadline_s=ctx.deadline_s, eval_every=0)
    return Coordinator(strategy, transport, clock, None, policy, out), strategy


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _planned(out: Path) -> list[tuple]:
    """Per round: each board's spec, reason and speed factor before and after, and the re-plans."""
    return [
        (r["round"], sorted((d, p["spec"], p["reason"], p["speed"], p["speed_after"]) for d, p in r["plans"].items()),
         r.get("replans", []))
        for r in _records(out)
    ]  # fmt: skip


def test_a_resumed_run_keeps_the_speed_factors_and_plans_as_an_uninterrupted_one(tmp_path: Path) -> None:
    local, rounds = {"local_steps": 1, "batch_size": 32, "momentum": 0.9}, SLOW_UNTIL
    whole, _ = _slowed_fleet(rounds, tmp_path / "whole", local)
    whole.run()
    # interrupted after the first slow round (the nano's factor is well above 1 now), resumed by a new server
    first, strategy = _slowed_fleet(rounds, tmp_path / "cut", local)
    for r in range(SLOW_FROM + 1):
        first.run_round(r)
    assert strategy.feedback.factor(device_id(0)) > 1.5
    resumed, again = _slowed_fleet(rounds, tmp_path / "cut", local)
    assert resumed.resume() == SLOW_FROM + 1 and again.feedback.factors == strategy.feedback.factors
    resumed.run()
    assert _planned(tmp_path / "cut") == _planned(tmp_path / "whole")
    replanned = [r["round"] for r in _records(tmp_path / "whole") for m in r.get("replans", [])]
    assert replanned == [SLOW_FROM + 1]  # the round planned right after the cut: a restart at 1 would miss it

    summary = summarise_plans(_records(tmp_path / "cut"))
    nano = summary["plans"][device_id(0)]
    assert nano["rounds"] == rounds and len(nano["specs"]) == 2 and nano["replans"] == 1
    assert summary["replans"][0]["round"] == SLOW_FROM + 1 and summary["replans"][0]["device"] == device_id(0)
    assert nano["spec"] == nano["specs"][-1] and nano["speed"] == _records(tmp_path / "cut")[-1]["plans"][
        device_id(0)]["speed_after"]  # fmt: skip
