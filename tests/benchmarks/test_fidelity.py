"""benchmarks/fidelity.py: the comparison of simulated and fleet round durations (fast), and a tiny run of both (slow)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from benchmarks import _fidelity_compare as fidelity_compare
from benchmarks import _fidelity_mixed as fidelity_mixed
from benchmarks import fidelity
from nestling.edge.emulation import TaskPacing
from nestling.messages import Task


def record(round_index: int, start: float, end: float) -> dict:
    return {"round": round_index, "dispatched_at": start, "closed_at": end, "virtual_time": end}


def test_round_durations_run_from_the_first_task_sent_to_the_close() -> None:
    # virtual clock in the simulator, monotonic wall clock on the fleet: only the differences count
    assert fidelity.round_durations([record(0, 0.0, 3.0), record(1, 3.0, 7.5)]) == {0: 3.0, 1: 4.5}
    assert fidelity.round_durations([record(0, 9727.2, 9730.2)]) == {0: pytest.approx(3.0)}


def test_errors_are_relative_to_the_simulators_prediction() -> None:
    rows = fidelity.compare({0: 2.0, 1: 4.0, 2: 5.0}, {0: 2.2, 1: 3.8, 2: 5.0})
    assert [round(r.error, 6) for r in rows] == [0.1, -0.05, 0.0]
    assert fidelity.error_summary(rows) == (pytest.approx(0.05), pytest.approx(0.1))
    assert fidelity.final_line(rows) == "median_abs_err=0.050 worst_err=0.100"
    text = fidelity.table(rows, {0: ["a", "b"]}, {0: "a (rpi4)"}, {0: 0.25})
    assert "| 0 | 2 | 2.000 | 2.200 | +0.100 | a (rpi4) | 0.250 |" in text


def test_rounds_must_match_and_take_time() -> None:
    with pytest.raises(ValueError, match="rounds differ"):
        fidelity.compare({0: 1.0, 1: 1.0}, {0: 1.0})
    with pytest.raises(ValueError, match="simulated duration"):
        fidelity.compare({0: 0.0}, {0: 1.0})


def test_the_agents_emulation_lines_are_read_back() -> None:
    pacing = TaskPacing(
        down_s=0.1, compute_s=2.5, up_s=0.2, slept_s=1.9, overrun_s=0.0, measured_compute_s=0.9
    )
    log = (
        f"2026-11-22 02:40:45,450 nestling.agent INFO {pacing.line(4, 'rpi4')}\n"
        "2026-11-22 02:40:45,461 nestling.agent INFO round 4: sent r4-dev-00002 for submodel 30f0 (1.11 MB)\n"
    )
    assert fidelity.parse_agent_log(log) == {
        4: {"down_s": 0.1, "compute_s": 2.5, "host_s": 0.9, "up_s": 0.2, "slept_s": 1.9, "overrun_s": 0.0}
    }


def test_both_worlds_share_method_seed_participation_deadline_and_quorum() -> None:
    args = fidelity.argparse.Namespace(
        devices=20,
        per_round=4,
        rounds=3,
        seed=1,
        deadline=60.0,
        dataset="digits",
        model="resnet20",
        method="fedavg",
        local_epochs=2,
        batch=32,
        lr=0.05,
    )
    shared = fidelity.shared_config(args)
    assert int(shared["train"]["fraction"] * 20) == 4
    assert shared["run"]["over_selection"] == 1.0 and shared["run"]["quorum"] == 1.0
    toml = fidelity.toml_tables({"run": shared["run"], "method": {"name": "fedavg", "flex": None}})
    assert "[run]\nrounds = 3\nseed = 1\n" in toml and 'name = "fedavg"\n' in toml and "flex" not in toml


@pytest.mark.slow
def test_a_tiny_replay_runs_in_both_worlds(tmp_path, capsys: pytest.CaptureFixture) -> None:
    assert (
        fidelity.main(
            [
                "--devices",
                "3",
                "--per-round",
                "2",
                "--rounds",
                "2",
                "--local-epochs",
                "1",
                "--settle",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "same devices every round in both worlds: yes" in out and "3 agents emulating rpi4" in out
    median, worst = map(
        float, re.fullmatch(r"median_abs_err=(\S+) worst_err=(\S+)", out.strip().splitlines()[-1]).groups()
    )
    assert 0 <= median <= worst < 1.0  # two short rounds: only that the runs line up, not the 10 % goal


# -- --mixed: rounds compared by their sets, time-to-accuracy, host-bound rounds -----------------------------
def metrics_row(r: int, start: float, end: float, acc: float, plans: dict | None = None) -> dict:
    return {
        "round": r,
        "dispatched_at": start,
        "closed_at": end,
        "submodels": [{"name": "full", "accuracy": acc}],
        "plans": plans or {},
    }


def test_replay_and_fleet_rounds_are_read_into_the_same_sets() -> None:
    from benchmarks import _fidelity_compare as fc

    timeline = [
        {"round": 0, "device_id": "a", "outcome": "used"},
        {"round": 0, "device_id": "b", "outcome": "dropped"},
        {"round": 0, "device_id": "c", "outcome": "used"},
        {"round": 0, "device_id": "d", "outcome": "cancelled"},
    ]
    sim = fc.replay_outcomes([metrics_row(0, 0.0, 4.0, 0.5)], timeline)
    plans = {d: {"censored": d in ("b", "d")} for d in "abcd"}
    log = "2026-11-26 INFO round 0: abandoned r0-b while training: the board left (its availability window closed)"
    fleet = fc.fleet_outcomes(
        [metrics_row(0, 100.0, 104.2, 0.5, plans)], fc.left_mid_task({"b": log, "d": ""})
    )
    assert sim[0].selected == fleet[0].selected == frozenset("abcd")
    assert sim[0].used == fleet[0].used == frozenset("ac") and sim[0].dropped == fleet[
        0
    ].dropped == frozenset("b")
    rows = fc.pair_rounds(sim, fleet, {0: {"a": 0.01, "d": 3.0}})  # d's overrun: a cancelled task, harmless
    assert rows[0].same_selection and rows[0].error == pytest.approx(0.05) and not rows[0].host_bound
    assert fc.pair_rounds(sim, fleet, {0: {"c": 0.5}})[
        0
    ].host_bound  # a used result came late because of the host
    with pytest.raises(ValueError, match="one world only"):
        fc.pair_rounds(sim, [])


def test_time_to_accuracy_and_accuracy_at_equal_time() -> None:
    from benchmarks import _fidelity_compare as fc

    def world(times: list[float], accs: list[float], plans: dict) -> list:
        rows = [metrics_row(i, times[i], times[i + 1], accs[i], plans) for i in range(len(accs))]
        return fc.fleet_outcomes(rows, {})

    plans = {"a": {"censored": False}}
    sim = world([0.0, 5.0, 10.0, 15.0], [0.3, 0.6, 0.8], plans)
    fleet = world([50.0, 55.5, 61.0, 66.5], [0.3, 0.6, 0.8], plans)
    v = fc.verdict(fc.pair_rounds(sim, fleet), target_share=0.9)
    assert v.target_accuracy == pytest.approx(0.72)
    assert (v.tta_simulated_s, v.tta_fleet_s) == (pytest.approx(15.0), pytest.approx(16.5))
    assert v.tta_error == pytest.approx(0.1)
    assert v.equal_time_s == pytest.approx(15.0) and (v.accuracy_simulated, v.accuracy_fleet) == (0.8, 0.6)
    assert fc.time_to_accuracy(sim, 0.99) is None and fc.accuracy_at(sim, 1.0) is None
    line = fc.final_line(v, classes=4, dropouts=2)
    assert (
        line == "classes=4 dropouts=2 median_abs_err=0.100 worst_err=0.100 tta_err=0.100 same_selection=3/3"
    )
    bound = fc.verdict(fc.pair_rounds(sim, fleet, {1: {"a": 1.0}}))
    assert bound.host_bound_rounds == [1]
    assert fc.final_line(bound, 4, 2).endswith(
        "median_abs_err=host_bound worst_err=host_bound tta_err=host_bound same_selection=3/3"
    )
    assert "HOST-BOUND" in "\n".join(fidelity_mixed.describe(bound))


def test_departures_and_returns_are_checked_against_the_windows() -> None:
    from nestling.profiler.traces import DeviceTrace

    trace = DeviceTrace(
        "t", "rpi3b", 2**30, 1e6, 1e6, 0.01, gflops=3.0, availability=((0.0, 10.0), (15.0, 1e12))
    )
    log = (
        "x INFO leaving: trace device t goes offline at trace time 10.020 s\n"
        "x INFO returning: trace device t comes online at trace time 15.010 s\n"
    )
    assert fidelity_compare.comings_and_goings(log) == [("left", 10.02), ("returned", 15.01)]
    assert fidelity_mixed.window_deviations({"dev": log}, {"dev": trace}) == [
        pytest.approx(0.02),
        pytest.approx(0.01),
    ]


def test_the_mixed_trace_has_four_classes_that_come_and_go() -> None:
    a = fidelity.argparse.Namespace(
        **{**fidelity_mixed.MIXED_DEFAULTS, "churn": 0.5, "online_h": 2.0, "offline_h": 1.0}
    )
    traces = fidelity_mixed.mixed_traces(a)
    assert len({t.device_class for t in traces}) == 4 and len(traces) == a.devices
    assert sum(bool(t.availability) for t in traces) == a.devices // 2
    assert all(t.is_available(0.0) for t in traces)  # every agent registers before the first round
    assert fidelity_mixed.server_gaps([metrics_row(1, 5.5, 9.0, 0.1), metrics_row(0, 0.0, 5.0, 0.1)]) == [0.5]


@pytest.mark.slow
def test_a_tiny_mixed_fleet_comes_and_goes_in_both_worlds(tmp_path, capsys: pytest.CaptureFixture) -> None:
    # 6 agents, 3 rounds, short sessions on a fast clock: dropouts happen, windows are kept, rounds compared.
    argv = ["--mixed", "--devices", "6", "--rounds", "3", "--local-epochs", "1", "--online-h", "0.5"]
    assert fidelity.main([*argv, "--offline-h", "0.25", "--settle", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    figures = dict(part.split("=") for part in last.split())
    assert figures["classes"] == "4" and int(figures["dropouts"]) >= 1
    assert re.fullmatch(r"\d/3", figures["same_selection"])
    assert (figures["tta_err"] == "host_bound") == ("HOST-BOUND" in out)  # never an error figure of the host
    windows = re.search(r"windows: (\d+) departures and returns by the agents, each within ([\d.]+) s", out)
    assert windows and int(windows.group(1)) >= 1 and float(windows.group(2)) < 0.5
    assert "reaches" in out and "server time between rounds" in out
    assert "replay transport time: transport_dispatch_s=" in out and "server_time=fixed+transport:" in out


def test_a_replay_is_reused_only_for_the_same_settings_and_trace(
    tmp_path, capsys: pytest.CaptureFixture
) -> None:
    a = fidelity.argparse.Namespace(
        **{**fidelity_mixed.MIXED_DEFAULTS, "out": tmp_path, "replay_only": False}
    )
    trace = tmp_path / "fleet.jsonl"
    trace.write_text('{"device_id": "a"}\n')
    sim = tmp_path / "sim"
    sim.mkdir()
    (sim / "metrics.jsonl").write_text(json.dumps(metrics_row(0, 0.0, 4.0, 0.5)) + "\n")
    (sim / "timeline.jsonl").write_text(json.dumps({"round": 0, "device_id": "a", "outcome": "used"}) + "\n")
    (sim / "replay-settings.json").write_text(fidelity_mixed.replay_fingerprint(a, trace))
    reused = fidelity_mixed.replay_once(a, trace, sim)
    assert reused["timeline"][0]["device_id"] == "a" and "reusing the replay" in capsys.readouterr().out
    other = fidelity.argparse.Namespace(**{**vars(a), "deadline": 99.0, "out": tmp_path / "elsewhere"})
    assert fidelity_mixed.replay_fingerprint(other, trace) != fidelity_mixed.replay_fingerprint(a, trace)
    assert fidelity_mixed.replay_fingerprint(
        fidelity.argparse.Namespace(**{**vars(a), "out": None, "settle": 9, "fleet_from": tmp_path}), trace
    ) == fidelity_mixed.replay_fingerprint(
        a, trace
    )  # where and how patiently to run, and which fleet, do not matter


def test_the_hosts_training_speed_is_read_from_the_emulation_lines() -> None:
    emulation = {0: {"a": {"compute_s": 2.0, "host_s": 1.0}, "b": {"compute_s": 3.0, "host_s": 0.0}}}
    assert fidelity_mixed.host_speeds(emulation, {"a": 4.0, "b": 1.0}) == [8.0]  # b: no training measured


def test_the_fixed_replay_moves_its_clock_by_the_fleets_mean_time_between_rounds() -> None:
    fleet = [metrics_row(0, 0.0, 5.0, 0.1), metrics_row(1, 5.5, 9.0, 0.1), metrics_row(2, 9.3, 12.0, 0.1)]
    assert fidelity_mixed.fixed_server_time(fleet) == {"server_time": "fixed", "server_round_s": 0.4}
    with pytest.raises(ValueError, match="one round"):
        fidelity_mixed.fixed_server_time(fleet[:1])
    assert fidelity_mixed.fixed_server_time(fleet, 0.5) == {"server_time": "fixed", "server_round_s": 0.5}


def test_a_replay_that_measures_its_server_time_is_never_reused(tmp_path) -> None:
    a = fidelity.argparse.Namespace(
        **{**fidelity_mixed.MIXED_DEFAULTS, "out": tmp_path, "replay_only": False}
    )
    trace = tmp_path / "fleet.jsonl"
    trace.write_text('{"device_id": "a"}\n')
    none = fidelity_mixed.replay_fingerprint(a, trace)
    fixed = fidelity_mixed.replay_fingerprint(a, trace, {"server_time": "fixed", "server_round_s": 0.4})
    other = fidelity_mixed.replay_fingerprint(a, trace, {"server_time": "fixed", "server_round_s": 0.5})
    assert len({none, fixed, other}) == 3
    assert none == fidelity_mixed.replay_fingerprint(a, trace, {})  # no server time: as before
    sim = tmp_path / "sim"
    sim.mkdir()
    (sim / "timeline.jsonl").write_text("{}\n")
    measured = {"server_time": "measured"}
    for server, print_ in ((None, none), ({"server_time": "fixed", "server_round_s": 0.4}, fixed)):
        (sim / "replay-settings.json").write_text(print_)
        assert fidelity_mixed.can_reuse(sim, print_, server)
        assert not fidelity_mixed.can_reuse(sim, other, server)
    stamp = fidelity_mixed.replay_fingerprint(a, trace, measured)
    (sim / "replay-settings.json").write_text(stamp)
    assert not fidelity_mixed.can_reuse(sim, stamp, measured)  # it measured this host, at that moment


def test_a_recorded_fleet_must_have_run_the_same_trace(tmp_path) -> None:
    trace = tmp_path / "fleet.jsonl"
    trace.write_text('{"device_id": "a"}\n')
    recorded = tmp_path / "recorded"
    a = fidelity.argparse.Namespace(**{**fidelity_mixed.MIXED_DEFAULTS, "fleet_from": recorded})
    with pytest.raises(ValueError, match="no finished fleet run there"):
        fidelity_mixed.recorded_fleet(a, trace)
    (recorded / "fleet").mkdir(parents=True)
    (recorded / "fleet" / "metrics.jsonl").write_text("")
    (recorded / "fleet.jsonl").write_text('{"device_id": "b"}\n')
    with pytest.raises(ValueError, match="another trace"):
        fidelity_mixed.recorded_fleet(a, trace)


def test_the_transport_figures_are_recovered_from_samples_the_model_makes() -> None:
    from benchmarks._fidelity_transport import derive
    from nestling.simulator.transport_time import MB, TransportTime

    truth = TransportTime(dispatch_s=0.01, dispatch_s_per_mb=0.04, hop_s=0.003, collect_s_per_mb=0.05)
    samples = []
    for mb in (0.02, 1.1):
        tasks = [Task(0, "d", {}, {"w": torch.zeros(int(mb * MB) // 4)}, "sgd")] * 4
        for k, reach in enumerate(truth.reach_s(tasks)):
            samples.append({"mb": mb, "k": k, "reach_s": reach, "back_s": truth.return_s(tasks[k])})
    derived = derive(samples)
    assert derived == pytest.approx(
        {
            "transport_dispatch_s": 0.01,
            "transport_dispatch_s_per_mb": 0.04,
            "transport_hop_s": 0.003,
            "transport_collect_s_per_mb": 0.05,
        },
        abs=1e-6,
    )
    with pytest.raises(ValueError, match="two sizes"):
        derive([s for s in samples if s["mb"] == 1.1])


def test_the_fair_replays_transport_figures_can_come_from_a_file(tmp_path) -> None:
    a = fidelity.argparse.Namespace(transport_from=tmp_path / "transport.json")
    keys = {
        "transport_time": "fixed",
        "transport_dispatch_s": 0.01,
        "transport_dispatch_s_per_mb": 0.04,
        "transport_hop_s": 0.003,
        "transport_collect_s_per_mb": 0.05,
    }
    a.transport_from.write_text(json.dumps({**keys, "samples": []}))
    assert fidelity_mixed.transport_time(a, tmp_path) == keys
    a.transport_from.write_text(json.dumps({"transport_time": "fixed", "transport_hop_s": 0.003}))
    with pytest.raises(ValueError, match="no transport_dispatch_s, transport_dispatch_s_per_mb"):
        fidelity_mixed.transport_time(a, tmp_path)


@pytest.mark.slow
def test_the_transport_is_measured_through_the_real_server_transport_and_broker() -> None:
    from benchmarks._fidelity_transport import measure

    samples = measure(boards=2, rounds=1, hold_s=0.2)
    assert len(samples) == 4 and {s["k"] for s in samples} == {0, 1}
    assert len({s["mb"] for s in samples}) == 2
    # Every task reached its board after the dispatch began, and every result took time to come back.
    assert all(0 < s["reach_s"] < 5 and 0 < s["back_s"] < 5 for s in samples)
