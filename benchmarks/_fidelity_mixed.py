"""`benchmarks/fidelity.py --mixed`: a mixed, flaky fleet replayed in the simulator and run as emulated agents.

The trace: four CPU-training board classes (Raspberry Pi 3 B, Pi Zero 2 W, Pi 4 and a Jetson Nano's CPU: the
catalogue classes slow enough for this 2-core host to outrun while three train at once; the Nano's GPU, the
phones and the Pi 5 are 2-5x faster than one of its cores), each device spread log-normally around its class
(simulator/generate.py). A share of the devices churns: online and offline sessions of exponential length on
the trace's clock in hours (`with_sessions`), every device online at t = 0. The trace's clock runs
`--time-scale` times faster than the wall clock in both worlds: the simulator replays
`time_scaled(trace, scale)`, each agent runs `--emulate-availability --emulate-time-scale scale` and really
leaves the broker when its window closes (the task it holds is abandoned, its result never sent) and registers
again when the next opens. Over-selection and a deadline as a deployment would set them.

Compared round by round (benchmarks/_fidelity_compare.py): the devices selected, the results used before the
deadline, the devices lost mid-task, the round's duration; then time-to-accuracy (wall time from the first
round's dispatch to the close of the first round evaluated at the target) and each world's accuracy at the
wall time both ran. Tasks the host could not keep up with (overrun) are reported per round; if one may have
changed a round, the error figures read `host_bound` instead of measuring this host.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.fidelity --mixed
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from benchmarks._fidelity_compare import (
    Verdict,
    comings_and_goings,
    final_line,
    fleet_outcomes,
    left_mid_task,
    pair_rounds,
    replay_outcomes,
    round_table,
    verdict,
)
from benchmarks.fidelity import read_jsonl, run_fleet, run_simulator

MIXED_MIX = "rpi3b:1,rpi-zero2w:1,rpi4:1,jetson-nano-cpu:1"
MIXED_DEFAULTS: dict[str, Any] = {
    "devices": 12,
    # Two devices asked, the first result used: two trainings at once is what this 2-core host can run at the
    # fast classes' speed (with three at once it trained at 5-21 GFLOP/s, median 8, and fell 1-3 s behind the
    # 10-12.5 GFLOP/s Pi 4s and Nano CPUs in 10 of 12 rounds, 2026-11-26 20:10 at load 3-6).
    "per_round": 1,
    "over_selection": 2.0,
    "rounds": 12,
    "mix": MIXED_MIX,
    "deadline": 15.0,
    "local_epochs": 5,
    "seed": 30,
}
# What the server counts when bytes travel twice (server/chunk_exchange.py, server/mqtt_transport.py).
RETRANSMISSION_COUNTERS = ("rerequests", "task_chunks_resent", "tasks_resent")
HOUR_S = 3600.0
DAY_S = 86400.0


def mixed_traces(a: argparse.Namespace) -> list[Any]:
    """The seeded trace on its own clock (hours): the class mix, with a churning share of the devices."""
    from nestling.simulator.generate import generate_fleet, with_sessions

    traces = generate_fleet(a.mix, a.devices, seed=a.seed, diurnal=False)
    return with_sessions(traces, a.churn, a.online_h * HOUR_S, a.offline_h * HOUR_S, DAY_S, seed=a.seed)


def window_deviations(agent_logs: Mapping[str, str], scaled: Mapping[str, Any]) -> list[float]:
    """For every departure and return an agent logged: seconds between its trace time and the nearest edge of
    its (scaled) trace's windows that it should have crossed (0 = exactly on the trace's clock)."""
    deviations = []
    for device, text in agent_logs.items():
        trace = scaled[device]
        ends = [end for _, end in trace.availability]
        starts = [start for start, _ in trace.availability]
        for kind, t in comings_and_goings(text):
            edges = ends if kind == "left" else starts
            deviations.append(min((abs(t - e) for e in edges), default=math.inf))
    return deviations


def server_gaps(metrics: Sequence[Mapping[str, Any]]) -> list[float]:
    """Seconds between one round's close and the next one's dispatch: the server's own work (screening,
    aggregation, evaluation, checkpoint, selection), which a replay's virtual clock does not advance for."""
    ordered = sorted(metrics, key=lambda r: int(r["round"]))
    return [float(b["dispatched_at"]) - float(a["closed_at"]) for a, b in pairwise(ordered)]


def unmodelled(
    v: Verdict, fleet_metrics: Sequence[Mapping[str, Any]], counters: Mapping[str, Any]
) -> list[str]:
    """What the replay leaves out, as measured in this run: transport inside a round, server time between
    rounds, retransmissions."""
    same = [row for row in v.rows if row.same_selection and not row.host_bound]
    transport = [row.fleet.duration_s - row.simulated.duration_s for row in same]
    gaps = server_gaps(fleet_metrics)
    lines = []
    if transport:
        share = statistics.median(
            (row.fleet.duration_s - row.simulated.duration_s) / row.simulated.duration_s for row in same
        )
        lines.append(
            f"broker and transport inside a round (fleet - simulated, {len(same)} rounds with the same sets): "
            f"median {statistics.median(transport) * 1e3:+.0f} ms ({share:+.1%} of the round)"
        )
    if gaps:
        mean_round = statistics.mean(row.fleet.duration_s for row in v.rows)
        lines.append(
            f"server time between rounds (aggregation, evaluation, selection; not in a round's span, not in the "
            f"replay's clock): mean {statistics.mean(gaps):.3f} s, max {max(gaps):.3f} s "
            f"({statistics.mean(gaps) / mean_round:.1%} of a mean round)"
        )
    resent = {k: counters.get(k, 0) for k in RETRANSMISSION_COUNTERS}
    lines.append(
        "retransmissions (server counters; the replay sends every byte once): "
        + ", ".join(f"{k}={v}" for k, v in resent.items())
    )
    return lines


def describe(v: Verdict) -> list[str]:
    """The round table, time-to-accuracy in both worlds, and the host-bound warning when there is one."""
    lines = [round_table(v)]
    for world, tta, acc in (
        ("simulator", v.tta_simulated_s, v.accuracy_simulated),
        ("fleet", v.tta_fleet_s, v.accuracy_fleet),
    ):
        reached = "never" if tta is None else f"{tta:.1f} s"
        at = "–" if acc is None else f"{100 * acc:.1f} %"
        lines.append(
            f"{world}: reaches {100 * v.target_accuracy:.1f} % after {reached}; accuracy at {v.equal_time_s:.1f} s: {at}"
        )
    if v.host_bound_rounds:
        lines.append(
            f"HOST-BOUND: the host fell behind its emulated boards in rounds {v.host_bound_rounds} by more than "
            "5 % of the round (column 'host overrun'): the fleet's times there measure this host, not the "
            "simulator; rerun on a quieter host"
        )
    return lines


def replay_fingerprint(a: argparse.Namespace, trace_path: Path) -> str:
    """What makes two replays the same: every setting but where and how long to run, and the trace itself."""
    settings = {k: v for k, v in vars(a).items() if k not in ("out", "replay_only", "timeout", "settle")}
    return json.dumps({**settings, "trace": trace_path.read_text()}, sort_keys=True, default=str)


def replay_once(a: argparse.Namespace, trace_path: Path, out: Path) -> dict[str, Any]:
    """The replay, or the one already in `out` from the same settings and trace (virtual time does not
    depend on this host's load, so `--replay-only` can run it before the box is quiet)."""
    fingerprint = replay_fingerprint(a, trace_path)
    stamp = out / "replay-settings.json"
    if stamp.exists() and stamp.read_text() == fingerprint and (out / "timeline.jsonl").exists():
        print(f"reusing the replay in {out} (same settings and trace)")
        return {
            "metrics": read_jsonl(out / "metrics.jsonl"),
            "timeline": read_jsonl(out / "timeline.jsonl"),
            "seconds": 0.0,
        }
    stamp.unlink(missing_ok=True)
    sim = run_simulator(a, trace_path, out)
    stamp.write_text(fingerprint)
    return sim


def host_speeds(
    emulation: Mapping[int, Mapping[str, Mapping[str, float]]], gflops: Mapping[str, float]
) -> list[float]:
    """GFLOP/s this host trained each task at (the board's FLOPs over the host's own training seconds), with
    as many tasks training at once as the run had: what decides which classes it can emulate."""
    rates = []
    for by_device in emulation.values():
        for device, figures in by_device.items():
            if figures["host_s"] > 0 and device in gflops:
                rates.append(figures["compute_s"] * gflops[device] / figures["host_s"])
    return sorted(rates)


def _dropped(sim: Mapping[str, Any]) -> int:
    return sum(row["outcome"] == "dropped" for row in sim["timeline"])


def run_mixed(a: argparse.Namespace) -> int:
    from nestling.profiler.traces import save_traces, time_scaled
    from nestling.simulator.fleetdata import device_id

    with tempfile.TemporaryDirectory() as scratch:
        work = (a.out or Path(scratch)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        traces = mixed_traces(a)
        trace_path, scaled_path = work / "fleet.jsonl", work / "fleet-scaled.jsonl"
        save_traces(traces, trace_path)
        scaled = [time_scaled(t, a.time_scale) for t in traces]
        save_traces(scaled, scaled_path)
        sim = replay_once(a, scaled_path, work / "sim")
        if a.replay_only:
            print(f"replay in {work / 'sim'}: {len(sim['metrics'])} rounds, {_dropped(sim)} dropouts")
            return 0
        flags = ["--emulate-availability", "--emulate-time-scale", repr(a.time_scale)]
        fleet = run_fleet(a, traces, trace_path, work, agent_flags=flags)
        summary_counters = _fleet_counters(work / "fleet")
    simulated = replay_outcomes(sim["metrics"], sim["timeline"])
    lost = left_mid_task(fleet["agent_logs"])
    real = fleet_outcomes(fleet["metrics"], lost)
    overruns = {r: {d: f["overrun_s"] for d, f in by.items()} for r, by in fleet["emulation"].items()}
    rows = pair_rounds(simulated, real, overruns)
    v = verdict(rows, a.target_share)
    classes = Counter(t.device_class for t in traces)
    churning = sum(bool(t.availability) for t in traces)
    by_id = {device_id(i): scaled[i] for i in range(len(traces))}
    deviations = window_deviations(fleet["agent_logs"], by_id)
    dropouts = sum(len(devices) for devices in lost.values())
    print(
        f"trace: {a.devices} devices ({', '.join(f'{n} {c}' for c, n in classes.items())}; seed {a.seed}), "
        f"{churning} come and go (sessions {a.online_h:g} h online / {a.offline_h:g} h offline on average), "
        f"clock x{a.time_scale:g}; {a.model} on {a.dataset}, {a.method}, {a.per_round} results a round from "
        f"{math.ceil(a.per_round * a.over_selection)} asked, deadline {a.deadline:g} s, {a.local_epochs} local epochs"
    )
    print(
        "GFLOP/s: "
        + ", ".join(
            f"{device_id(i)[-2:]}={t.gflops:g}{'*' if t.availability else ''}" for i, t in enumerate(traces)
        )
        + " (* comes and goes)"
    )
    print(
        f"simulator: {sim['seconds']:.1f} s; fleet: {fleet['seconds']:.1f} s wall ({fleet['agents_ready_s']:.1f} s "
        f"starting {a.devices} agents)"
    )
    rates = host_speeds(fleet["emulation"], {device_id(i): t.gflops for i, t in enumerate(traces)})
    if rates:
        print(
            f"host: trained {len(rates)} tasks at {rates[0]:.1f}-{rates[-1]:.1f} GFLOP/s "
            f"(median {statistics.median(rates):.1f}) with up to {math.ceil(a.per_round * a.over_selection)} at once"
        )
    print(
        f"windows: {len(deviations)} departures and returns by the agents, each within "
        f"{max(deviations, default=0.0):.3f} s of its trace's window edge (scaled clock)"
    )
    print(
        f"dropouts (left holding a task, result never sent): fleet {dropouts}, simulator "
        f"{sum(len(o.dropped) for o in simulated)}"
    )
    for line in describe(v):
        print(line)
    for line in unmodelled(v, fleet["metrics"], summary_counters):
        print(line)
    if v.host_bound_rounds:
        errors = [abs(row.error) for row in v.rows]
        print(
            f"(as measured, host included: median |error| {statistics.median(errors):.3f}, worst "
            f"{max(errors):.3f}, tta error {'none' if v.tta_error is None else f'{abs(v.tta_error):.3f}'})"
        )
    print(final_line(v, len(classes), dropouts))
    return 0


def _fleet_counters(out: Path) -> dict[str, Any]:
    path = out / "summary.json"
    if not path.exists():
        return {}
    summary = json.loads(path.read_text())
    counters = summary.get("counters") or summary.get("transport") or {}
    return counters if isinstance(counters, dict) else {}
